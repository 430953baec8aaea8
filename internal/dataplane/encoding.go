package dataplane

import (
	"encoding/binary"
	"encoding/json"
	"mime"
	"net/http"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
)

// Encodings of an output stream (docs/dataplane.md): SSE with base64 output (the
// default), SSE with UTF-8 text output, or binary frames with raw output.
const (
	EncodingBase64 = "base64"
	EncodingText   = "text"
	EncodingFrames = "frames"
)

// ParseEncoding returns the encoding a request asks for: ?encoding= when given, else
// frames when Accept names api.FramesContentType, else base64.
func ParseEncoding(r *http.Request) (string, error) {
	switch e := r.URL.Query().Get("encoding"); e {
	case EncodingBase64, EncodingText, EncodingFrames:
		return e, nil
	case "":
	default:
		return "", rest.Invalid("encoding must be base64, text or frames")
	}
	for _, part := range strings.Split(r.Header.Get("Accept"), ",") {
		if mt, _, err := mime.ParseMediaType(strings.TrimSpace(part)); err == nil && mt == api.FramesContentType {
			return EncodingFrames, nil
		}
	}
	return EncodingBase64, nil
}

// Encoder writes an output stream: what the agent sent (Frame) and the events the
// relay adds itself.
type Encoder interface {
	Start(api.StartEvent) error
	// Frame writes an agent frame: output, gap, exit; a heartbeat as a keepalive.
	// Agent start frames are not passed on (Start is the relay's).
	Frame(wire.Frame) error
	Error(msg string) error
	Lost(api.LostEvent) error
	Flush() error
	// Merge reports whether output frames should be merged before Frame (SSE pays per
	// event; frames do not).
	Merge() bool
}

// NewEncoder answers the request with status 200 and returns the encoder of enc.
func NewEncoder(w http.ResponseWriter, enc string) Encoder {
	if enc == EncodingFrames {
		return newFrameEncoder(w)
	}
	return &sseEncoder{s: rest.NewSSE(w), text: enc == EncodingText}
}

type sseEncoder struct {
	s    *rest.SSE
	text bool
}

func (e *sseEncoder) Start(ev api.StartEvent) error { return e.s.Event("", api.EventStart, ev) }
func (e *sseEncoder) Frame(f wire.Frame) error      { return WriteFrame(e.s, f, e.text) }
func (e *sseEncoder) Error(msg string) error {
	return e.s.Event("", api.EventError, map[string]string{"message": msg})
}
func (e *sseEncoder) Lost(ev api.LostEvent) error { return e.s.Event("", api.EventLost, ev) }
func (e *sseEncoder) Flush() error                { return e.s.Flush() }
func (e *sseEncoder) Merge() bool                 { return true }

// frameEncoder writes api frames. Stdout, stderr and heartbeat frames have the agent's
// layout (type numbers, offset, length), so their payload goes out as it came.
type frameEncoder struct {
	w  http.ResponseWriter
	rc *http.ResponseController
}

func newFrameEncoder(w http.ResponseWriter) *frameEncoder {
	h := w.Header()
	h.Set("Content-Type", api.FramesContentType)
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	e := &frameEncoder{w: w, rc: http.NewResponseController(w)}
	_ = e.rc.SetWriteDeadline(time.Time{}) // a long-lived stream
	_ = e.rc.Flush()
	return e
}

func (e *frameEncoder) write(typ byte, off int64, payload []byte) error {
	var h [api.FrameHeaderSize]byte
	h[0] = typ
	binary.BigEndian.PutUint64(h[1:9], uint64(off))
	binary.BigEndian.PutUint32(h[9:13], uint32(len(payload)))
	if _, err := e.w.Write(h[:]); err != nil {
		return err
	}
	if len(payload) == 0 {
		return nil
	}
	_, err := e.w.Write(payload)
	return err
}

func (e *frameEncoder) json(typ byte, off int64, v any) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return e.write(typ, off, b)
}

func (e *frameEncoder) Start(ev api.StartEvent) error { return e.json(api.FrameStart, ev.Offset, ev) }

func (e *frameEncoder) Frame(f wire.Frame) error {
	switch f.Type {
	case wire.FrameStdout:
		return e.write(api.FrameStdout, f.Offset, f.Payload)
	case wire.FrameStderr:
		return e.write(api.FrameStderr, f.Offset, f.Payload)
	case wire.FrameGap:
		return e.json(api.FrameGap, f.Offset, api.GapEvent{Offset: f.Offset, Dropped: gapDropped(f)})
	case wire.FrameExit:
		return e.json(api.FrameExit, f.Offset, exitEvent(f))
	case wire.FrameHeartbeat:
		return e.write(api.FrameHeartbeat, f.Offset, nil)
	default:
		return nil
	}
}

func (e *frameEncoder) Error(msg string) error {
	return e.json(api.FrameError, 0, map[string]string{"message": msg})
}
func (e *frameEncoder) Lost(ev api.LostEvent) error { return e.json(api.FrameLost, 0, ev) }
func (e *frameEncoder) Flush() error                { return e.rc.Flush() }
func (e *frameEncoder) Merge() bool                 { return false }

// gapDropped is the count of dropped bytes a gap frame carries.
func gapDropped(f wire.Frame) int64 {
	var dropped int64
	if len(f.Payload) >= 8 {
		dropped = int64(binary.BigEndian.Uint64(f.Payload[:8]))
	}
	return dropped
}

// exitEvent is the exit event of an exit frame.
func exitEvent(f wire.Frame) api.ExitEvent {
	var ex wire.Exit
	_ = json.Unmarshal(f.Payload, &ex)
	return api.ExitEvent{ExitCode: ex.ExitCode, Signal: ex.Signal, Offset: f.Offset, Error: ex.Error, TimedOut: ex.TimedOut}
}
