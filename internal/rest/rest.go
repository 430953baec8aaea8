// Package rest owns the HTTP conventions space's JSON APIs share: the one mapping from
// error kinds (internal/fault) to HTTP status codes, JSON error bodies, strict JSON
// request decoding, bearer credentials and the Server-Sent Events writer. The control
// plane (internal/server) and the node's data plane (internal/dataplane) use it; the
// E2B gateway maps errors through StatusOf but writes E2B's own error bodies.
package rest

import (
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// MaxBodyBytes bounds JSON request bodies.
const MaxBodyBytes = 1 << 20

// statusOf is the one place where error kinds become HTTP status codes.
func statusOf(k fault.Kind) int {
	switch k {
	case fault.NotFound:
		return http.StatusNotFound
	case fault.Conflict:
		return http.StatusConflict
	case fault.Invalid:
		return http.StatusBadRequest
	case fault.Unauthorized:
		return http.StatusUnauthorized
	case fault.Forbidden:
		return http.StatusForbidden
	case fault.TooLarge:
		return http.StatusRequestEntityTooLarge
	case fault.Unavailable:
		return http.StatusServiceUnavailable
	case fault.Unprocessable:
		return http.StatusUnprocessableEntity
	case fault.Timeout:
		return http.StatusGatewayTimeout
	case fault.Gone:
		return http.StatusGone
	case fault.InsufficientStorage:
		return http.StatusInsufficientStorage
	case fault.BadGateway:
		return http.StatusBadGateway
	case fault.TooManyRequests:
		return http.StatusTooManyRequests
	case fault.QuotaExceeded:
		return http.StatusForbidden
	default:
		return http.StatusInternalServerError
	}
}

// StatusOf maps an error to its HTTP status.
func StatusOf(err error) int { return statusOf(fault.KindOf(err)) }

// WriteJSON writes v as the JSON body of a response with status.
func WriteJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}

// WriteError writes err as an api.Error body. Internal errors are logged and their
// details hidden from the client.
func WriteError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	if ShuttingDown(r) {
		err = ErrShuttingDown
	}
	k := fault.KindOf(err)
	msg := fault.Message(err)
	if k == fault.Internal {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		msg = "internal error"
	}
	body := api.ErrorBody{Code: k.String(), Message: msg}
	if l, ok := fault.DetailOf(err).(*api.LimitExceeded); ok {
		body.Limit = l
	}
	SetRetryAfter(w, err)
	WriteJSON(w, statusOf(k), api.Error{Error: body})
}

// ErrShuttingDown is the cause with which a server ends the contexts of the requests
// still in flight when its stop's grace has passed (Serve), and of the streams a client
// resumes by itself when the stop begins (EndAtStop). They are answered 503 with
// Retry-After, to be sent again to the next process (a restart: with the listening
// socket passed by systemd they wait in its queue). Until 2026-12-07 a request whose
// context ended so was taken for one whose client had gone, and got nothing written:
// an empty 200, which the E2B SDKs took for a created sandbox without an id, an empty
// file, or a Connect answer without a content type.
var ErrShuttingDown = fault.Later(fault.New(fault.Unavailable, "space is restarting; retry shortly"), time.Second)

// ShuttingDown reports whether r's context ended because its server is stopping
// (Serve), not because its client went away.
func ShuttingDown(r *http.Request) bool { return Stopping(r.Context()) }

// SetRetryAfter sets Retry-After on the answer to an error a client should send again
// later: a conflict that passes on its own (fault.Later, in whole seconds rounded up)
// or too many requests (1 s). Every API's error writer calls it; the E2B-compatible
// API writes bodies of its own.
func SetRetryAfter(w http.ResponseWriter, err error) {
	if d := fault.RetryAfterOf(err); d > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int((d+time.Second-1)/time.Second)))
	} else if fault.KindOf(err) == fault.TooManyRequests {
		w.Header().Set("Retry-After", "1")
	}
}

// HandlerFunc is an HTTP handler that returns an error, written by Handle.
type HandlerFunc func(w http.ResponseWriter, r *http.Request) error

// Handle adapts h to http.Handler, writing its error with WriteError.
func Handle(log *slog.Logger, h HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if err := h(w, r); err != nil {
			WriteError(w, r, log, err)
		}
	})
}

// DecodeJSON decodes a JSON request body strictly: unknown fields, trailing data, wrong
// types, a null body and oversized bodies are client errors.
func DecodeJSON(w http.ResponseWriter, r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return fault.New(fault.Invalid, "Content-Type must be application/json")
	}
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	var raw json.RawMessage
	if err := dec.Decode(&raw); err != nil {
		return JSONError(err)
	}
	if dec.More() {
		return fault.New(fault.Invalid, "request body has data after the JSON value")
	}
	if _, err := io.Copy(io.Discard, body); err != nil {
		return JSONError(err)
	}
	if string(raw) == "null" {
		return fault.New(fault.Invalid, "request body must be a JSON object, not null")
	}
	strict := json.NewDecoder(strings.NewReader(string(raw)))
	strict.DisallowUnknownFields()
	if err := strict.Decode(v); err != nil {
		return JSONError(err)
	}
	return nil
}

// DecodeOptionalJSON is DecodeJSON that accepts an empty body.
func DecodeOptionalJSON(w http.ResponseWriter, r *http.Request, v any) error {
	if r.ContentLength == 0 {
		return nil
	}
	err := DecodeJSON(w, r, v)
	if err != nil && strings.Contains(err.Error(), "request body is empty") {
		return nil
	}
	return err
}

// JSONError turns a JSON decoding error into an Invalid (or TooLarge) fault.
func JSONError(err error) error {
	var mbe *http.MaxBytesError
	var se *json.SyntaxError
	var te *json.UnmarshalTypeError
	switch {
	case errors.As(err, &mbe):
		return fault.New(fault.TooLarge, "request body exceeds %d bytes", mbe.Limit)
	case errors.Is(err, io.EOF):
		return fault.New(fault.Invalid, "request body is empty")
	case errors.As(err, &se):
		return fault.New(fault.Invalid, "malformed JSON at byte %d: %v", se.Offset, se)
	case errors.As(err, &te):
		return fault.New(fault.Invalid, "field %q must be %s, not %s", te.Field, te.Type, te.Value)
	case strings.HasPrefix(err.Error(), "json: unknown field"):
		return fault.New(fault.Invalid, "%s", strings.TrimPrefix(err.Error(), "json: "))
	default:
		return fault.New(fault.Invalid, "malformed JSON: %v", err)
	}
}

// Invalid returns a fault.Invalid error with a formatted message.
func Invalid(format string, args ...any) error {
	return fault.New(fault.Invalid, format, args...)
}

// Bearer returns the credential from "Authorization: Bearer …" or "X-API-Key".
func Bearer(r *http.Request) string {
	if h := r.Header.Get("Authorization"); h != "" {
		if v, ok := strings.CutPrefix(h, "Bearer "); ok {
			return strings.TrimSpace(v)
		}
		return ""
	}
	return strings.TrimSpace(r.Header.Get("X-API-Key"))
}
