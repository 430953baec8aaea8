package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// maxBodyBytes bounds JSON request bodies.
const maxBodyBytes = 1 << 20

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
	default:
		return http.StatusInternalServerError
	}
}

// StatusOf maps an error to its HTTP status.
func StatusOf(err error) int { return statusOf(fault.KindOf(err)) }

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(v)
}

// writeError writes err as an api.Error body. Internal errors are logged and their
// details hidden from the client.
func writeError(w http.ResponseWriter, r *http.Request, log *slog.Logger, err error) {
	k := fault.KindOf(err)
	status := statusOf(k)
	msg := err.Error()
	if k == fault.Internal {
		log.Error("request failed", "method", r.Method, "path", r.URL.Path, "err", err)
		msg = "internal error"
	}
	writeJSON(w, status, api.Error{Error: api.ErrorBody{Code: k.String(), Message: msg}})
}

// decodeJSON decodes a JSON request body strictly: unknown fields, trailing data, wrong
// types and oversized bodies are client errors.
func decodeJSON(w http.ResponseWriter, r *http.Request, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" && !strings.HasPrefix(ct, "application/json") {
		return fault.New(fault.Invalid, "Content-Type must be application/json")
	}
	body := http.MaxBytesReader(w, r.Body, maxBodyBytes)
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return jsonError(err)
	}
	if dec.More() {
		return fault.New(fault.Invalid, "request body has data after the JSON value")
	}
	if _, err := io.Copy(io.Discard, body); err != nil {
		return jsonError(err)
	}
	return nil
}

func jsonError(err error) error {
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

// decodeOptionalJSON is decodeJSON that accepts an empty body.
func decodeOptionalJSON(w http.ResponseWriter, r *http.Request, v any) error {
	if r.ContentLength == 0 {
		return nil
	}
	err := decodeJSON(w, r, v)
	if err != nil && strings.Contains(err.Error(), "request body is empty") {
		return nil
	}
	return err
}

func invalid(format string, args ...any) error {
	return fault.New(fault.Invalid, format, args...)
}

// handlerFunc is an http handler that returns an error.
type handlerFunc func(w http.ResponseWriter, r *http.Request) error

func errorString(v any) string { return fmt.Sprint(v) }
