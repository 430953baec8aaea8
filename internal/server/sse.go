package server

import (
	"encoding/json"
	"fmt"
	"net/http"
	"time"
)

// sse writes a Server-Sent Events stream.
type sse struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

// heartbeatEvery is how often idle streams get a comment line so that proxies keep them
// open.
const heartbeatEvery = 15 * time.Second

func newSSE(w http.ResponseWriter) *sse {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	s := &sse{w: w, rc: http.NewResponseController(w)}
	// A long-lived stream must not be cut by the server's write timeout.
	_ = s.rc.SetWriteDeadline(time.Time{})
	_ = s.rc.Flush()
	return s
}

// event writes one event whose data is v encoded as a single JSON line. id may be empty.
func (s *sse) event(id, name string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if id != "" {
		if _, err := fmt.Fprintf(s.w, "id: %s\n", id); err != nil {
			return err
		}
	}
	if _, err := fmt.Fprintf(s.w, "event: %s\ndata: %s\n\n", name, data); err != nil {
		return err
	}
	return nil
}

func (s *sse) comment(text string) error {
	_, err := fmt.Fprintf(s.w, ": %s\n\n", text)
	return err
}

func (s *sse) flush() error { return s.rc.Flush() }
