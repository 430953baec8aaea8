package rest

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// SSE writes a Server-Sent Events stream.
type SSE struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// HeartbeatEvery is how often idle streams get a comment line so that proxies keep
// them open.
const HeartbeatEvery = 15 * time.Second

// NewSSE starts an event stream on w (status 200, event-stream headers, flushed).
func NewSSE(w http.ResponseWriter) *SSE {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &SSE{w: w, rc: http.NewResponseController(w)}
	// A long-lived stream must not be cut by the server's write timeout.
	_ = s.rc.SetWriteDeadline(time.Time{})
	_ = s.rc.Flush()
	return s
}

// Event writes one event whose data is v encoded as a single JSON line. id may be empty.
func (s *SSE) Event(id, name string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if id != "" {
		if _, err := fmt.Fprintf(s.w, "id: %s\n", id); err != nil {
			return err
		}
	}
	_, err = fmt.Fprintf(s.w, "event: %s\ndata: %s\n\n", name, data)
	return err
}

// Comment writes a comment line (used as a heartbeat).
func (s *SSE) Comment(text string) error {
	_, err := fmt.Fprintf(s.w, ": %s\n\n", text)
	return err
}

// Flush sends what is buffered.
func (s *SSE) Flush() error { return s.rc.Flush() }

// SetWriteDeadline bounds the next writes (a client that stopped reading is cut
// instead of holding the stream forever); the zero time removes the bound.
func (s *SSE) SetWriteDeadline(t time.Time) error { return s.rc.SetWriteDeadline(t) }
