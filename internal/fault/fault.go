// Package fault defines the kinds of failure space's components report (not found,
// conflict, invalid input, …). Components wrap errors with a Kind; the HTTP layer
// (internal/rest) maps kinds to status codes in exactly one place.
package fault

import (
	"errors"
	"fmt"
	"time"
)

// Kind classifies an error for callers and for the HTTP status mapping.
type Kind int

// Kinds of failure.
const (
	Internal Kind = iota
	NotFound
	Conflict     // the resource's state forbids the request (409)
	Invalid      // malformed or semantically invalid input (400)
	Unauthorized // missing or bad credentials (401)
	Forbidden    // credentials valid but not allowed (403)
	TooLarge     // request body too large (413)
	Unavailable  // a dependency is temporarily unavailable (503)
	Unprocessable
	Timeout
	Gone
	InsufficientStorage
	BadGateway      // a sandbox (its agent) answered badly: oversized, slow or malformed (502)
	TooManyRequests // a rate limit was reached (429)
	QuotaExceeded   // a tenant's quota would be exceeded (403)
)

var names = map[Kind]string{
	Internal:            "internal",
	NotFound:            "not_found",
	Conflict:            "conflict",
	Invalid:             "invalid_argument",
	Unauthorized:        "unauthorized",
	Forbidden:           "forbidden",
	TooLarge:            "too_large",
	Unavailable:         "unavailable",
	Unprocessable:       "unprocessable",
	Timeout:             "timeout",
	Gone:                "gone",
	InsufficientStorage: "insufficient_storage",
	BadGateway:          "bad_gateway",
	TooManyRequests:     "too_many_requests",
	QuotaExceeded:       "quota_exceeded",
}

// String returns the stable code used in API error bodies.
func (k Kind) String() string { return names[k] }

// Error is an error with a Kind and a message meant for API clients.
type Error struct {
	Kind Kind
	Msg  string
	Err  error
	// Detail is structured data for the client (e.g. the limit a request ran into);
	// the HTTP layer puts what it knows of it in the error body.
	Detail any
	// RetryAfter, when positive, says that the condition passes on its own (a
	// transition in flight): the same request is worth sending again after about this
	// long. The HTTP layer sends it as Retry-After.
	RetryAfter time.Duration
	// private says that Err's message is for the log only: clients are told Msg
	// (Redacted, Message).
	private bool
}

func (e *Error) Error() string {
	if e.Err != nil && e.Msg != "" {
		return e.Msg + ": " + e.Err.Error()
	}
	if e.Err != nil {
		return e.Err.Error()
	}
	return e.Msg
}

func (e *Error) Unwrap() error { return e.Err }

// New returns an error of kind k with a formatted message.
func New(k Kind, format string, args ...any) error {
	return &Error{Kind: k, Msg: fmt.Sprintf(format, args...)}
}

// Wrap gives err the kind k, keeping err's message.
func Wrap(k Kind, err error) error {
	if err == nil {
		return nil
	}
	return &Error{Kind: k, Err: err}
}

// Redacted gives err the kind k and the client message msg: err's own message (which
// names internals: a database's user, socket path, host) stays in Error, for the log,
// and is never sent to a client (Message).
func Redacted(k Kind, msg string, err error) error {
	return &Error{Kind: k, Msg: msg, Err: err, private: true}
}

// Message returns what an API client is told of err: its message, or where err wraps a
// Redacted error, that error's client message alone (what wraps it only adds where the
// failure was met).
func Message(err error) string {
	for e := err; e != nil; {
		var fe *Error
		if !errors.As(e, &fe) {
			break
		}
		if fe.private {
			return fe.Msg
		}
		e = fe.Err
	}
	return err.Error()
}

// WithDetail attaches structured detail to err (which keeps its kind and message).
func WithDetail(err error, detail any) error {
	return &Error{Kind: KindOf(err), Err: err, Detail: detail}
}

// Later marks err (which keeps its kind and message) as passing on its own: the same
// request may succeed when sent again after d.
func Later(err error, d time.Duration) error {
	return &Error{Kind: KindOf(err), Err: err, RetryAfter: d}
}

// RetryAfterOf returns the RetryAfter of the outermost *Error in err's chain that has
// one, 0 when none does.
func RetryAfterOf(err error) time.Duration {
	for err != nil {
		var e *Error
		if !errors.As(err, &e) {
			return 0
		}
		if e.RetryAfter > 0 {
			return e.RetryAfter
		}
		err = e.Err
	}
	return 0
}

// DetailOf returns the detail of the outermost *Error in err's chain that has one.
func DetailOf(err error) any {
	for err != nil {
		var e *Error
		if !errors.As(err, &e) {
			return nil
		}
		if e.Detail != nil {
			return e.Detail
		}
		err = e.Err
	}
	return nil
}

// KindOf reports the kind of the outermost *Error in err's chain (Internal if none).
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return Internal
}

// Is reports whether err has kind k.
func Is(err error, k Kind) bool { return err != nil && KindOf(err) == k }
