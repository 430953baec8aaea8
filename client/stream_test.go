package client

import (
	"bytes"
	"encoding/binary"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
)

// TestSSEParsing checks events, ids, comments, multi-line data and data lines longer
// than the reader's buffer.
func TestSSEParsing(t *testing.T) {
	long := strings.Repeat("A", 200000)
	body := ": keepalive\n\nevent: start\ndata: {\"pid\":1}\n\nid: 5\nevent: stdout\ndata: {\"data\":\"" + long + "\"}\n\n" +
		"data: a\ndata: b\n\n"
	st := &Stream{resp: &http.Response{Body: io.NopCloser(strings.NewReader(body))}, br: newReader(strings.NewReader(body))}
	var got []Event
	for {
		ev, err := st.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, ev)
	}
	if len(got) != 3 || got[0].Name != "start" || got[1].ID != "5" || len(got[1].Data) != len(long)+11 ||
		got[2].Name != "message" || string(got[2].Data) != "a\nb" {
		t.Fatalf("events: %d %+v", len(got), got)
	}
}

// TestFramesParsing checks the frames encoding: output bytes as they are (a payload
// larger than the reader's buffer included), resume ids, heartbeats and unknown types
// skipped, the exit status, and a stream cut inside a frame.
func TestFramesParsing(t *testing.T) {
	frame := func(typ byte, off int64, payload []byte) []byte {
		h := make([]byte, api.FrameHeaderSize)
		h[0] = typ
		binary.BigEndian.PutUint64(h[1:9], uint64(off))
		binary.BigEndian.PutUint32(h[9:13], uint32(len(payload)))
		return append(h, payload...)
	}
	big := bytes.Repeat([]byte{0xff, 0}, 100000)
	var body []byte
	body = append(body, frame(api.FrameStart, 0, []byte(`{"pid":3,"offset":0}`))...)
	body = append(body, frame(api.FrameStdout, 0, []byte{0xc3, 0x28})...)
	body = append(body, frame(api.FrameHeartbeat, 2, nil)...)
	body = append(body, frame(99, 2, []byte("from a newer server"))...)
	body = append(body, frame(api.FrameStderr, 2, big)...)
	body = append(body, frame(api.FrameGap, 300002, []byte(`{"offset":300002,"dropped":100000}`))...)
	body = append(body, frame(api.FrameExit, 300002, []byte(`{"exit_code":2,"offset":300002}`))...)
	resp := &http.Response{Header: http.Header{"Content-Type": {api.FramesContentType}}, Body: io.NopCloser(bytes.NewReader(body))}
	var stdout, stderr bytes.Buffer
	var gaps []api.GapEvent
	last := ""
	exit, err := readUntilExit(newStream(resp), &last, Output{Stdout: &stdout, Stderr: &stderr, OnGap: func(g api.GapEvent) { gaps = append(gaps, g) }})
	if err != nil || exit == nil || ExitCode(exit) != 2 || !bytes.Equal(stdout.Bytes(), []byte{0xc3, 0x28}) ||
		!bytes.Equal(stderr.Bytes(), big) || len(gaps) != 1 || gaps[0].Dropped != 100000 || last != "300002" {
		t.Fatalf("exit %+v err %v stdout %q stderr %d bytes gaps %v last %q", exit, err, stdout.Bytes(), stderr.Len(), gaps, last)
	}
	cut := body[:len(body)-5]
	resp = &http.Response{Header: http.Header{"Content-Type": {api.FramesContentType}}, Body: io.NopCloser(bytes.NewReader(cut))}
	last = ""
	if _, err := readUntilExit(newStream(resp), &last, Output{}); err != io.ErrUnexpectedEOF || last != "300002" {
		t.Fatalf("cut stream: %v, last id %q", err, last)
	}
}
