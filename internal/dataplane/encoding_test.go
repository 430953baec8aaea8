package dataplane_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/spacetest"
)

// frame is one frame of a stream in the frames encoding.
type frame struct {
	typ     byte
	offset  int64
	payload []byte
}

// frames reads a whole stream in the frames encoding.
func frames(t *testing.T, req *http.Request) []frame {
	t.Helper()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != api.FramesContentType {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("attach: %d %s %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	br := bufio.NewReader(resp.Body)
	var out []frame
	for {
		var h [api.FrameHeaderSize]byte
		if _, err := io.ReadFull(br, h[:]); err == io.EOF {
			return out
		} else if err != nil {
			t.Fatalf("frame header: %v", err)
		}
		f := frame{typ: h[0], offset: int64(binary.BigEndian.Uint64(h[1:9])), payload: make([]byte, binary.BigEndian.Uint32(h[9:13]))}
		if _, err := io.ReadFull(br, f.payload); err != nil {
			t.Fatalf("frame payload: %v", err)
		}
		out = append(out, f)
	}
}

// output checks that the output frames of fs chain from offset from and returns their
// bytes, the gap events and the exit event (which must come last).
func output(t *testing.T, fs []frame, from int64) ([]byte, []api.GapEvent, api.ExitEvent) {
	t.Helper()
	if len(fs) < 2 || fs[0].typ != api.FrameStart {
		t.Fatalf("stream does not begin with a start frame: %v", fs)
	}
	var start api.StartEvent
	if err := json.Unmarshal(fs[0].payload, &start); err != nil || start.Offset != from {
		t.Fatalf("start frame %s: %v", fs[0].payload, err)
	}
	var data []byte
	var gaps []api.GapEvent
	pos := from
	for i, f := range fs[1:] {
		switch f.typ {
		case api.FrameStdout, api.FrameStderr:
			if f.offset != pos {
				t.Fatalf("output frame at %d, want %d", f.offset, pos)
			}
			data = append(data, f.payload...)
			pos += int64(len(f.payload))
		case api.FrameGap:
			var g api.GapEvent
			if err := json.Unmarshal(f.payload, &g); err != nil || g.Offset != f.offset || g.Offset != pos+g.Dropped {
				t.Fatalf("gap frame at %d (stream at %d): %s %v", f.offset, pos, f.payload, err)
			}
			gaps = append(gaps, g)
			pos = g.Offset
		case api.FrameExit:
			var x api.ExitEvent
			if err := json.Unmarshal(f.payload, &x); err != nil || x.Offset != pos || f.offset != pos || i != len(fs)-2 {
				t.Fatalf("exit frame %s at %d (stream at %d, frame %d of %d): %v", f.payload, f.offset, pos, i+2, len(fs), err)
			}
			return data, gaps, x
		case api.FrameHeartbeat:
		default:
			t.Fatalf("unexpected frame type %d: %s", f.typ, f.payload)
		}
	}
	t.Fatalf("no exit frame")
	return nil, nil, api.ExitEvent{}
}

// The frames encoding carries output bytes as they are (not UTF-8, NUL included) at
// the offsets of the SSE encoding; resuming from an offset (?from= or Last-Event-ID)
// sends exactly what follows it; bytes that fell out of the journal are a gap frame;
// the encoding is chosen by Accept or ?encoding=frames.
func TestAttachFrames(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	want := []byte{'a', 0xff, 0, 0xfe, 'b', 0xc3, 0x28}
	sess, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: `printf 'a\377\000\376b\303('; exit 4`})
	if err != nil {
		t.Fatal(err)
	}
	data, gaps, exit := output(t, frames(t, attachReq(t, sess, "", "Accept", api.FramesContentType)), 0)
	if !bytes.Equal(data, want) || len(gaps) != 0 || exit.ExitCode == nil || *exit.ExitCode != 4 || exit.Offset != int64(len(want)) {
		t.Fatalf("frames: %q gaps %v exit %+v", data, gaps, exit)
	}
	for _, resume := range []struct{ query, header string }{{"?encoding=frames&from=2", ""}, {"?encoding=frames", "2"}} {
		req := attachReq(t, sess, resume.query)
		if resume.header != "" {
			req.Header.Set("Last-Event-ID", resume.header)
		}
		data, _, exit = output(t, frames(t, req), 2)
		if !bytes.Equal(data, want[2:]) || exit.Offset != int64(len(want)) {
			t.Fatalf("resume %+v: %q exit %+v", resume, data, exit)
		}
	}
	// The SSE encoding of the same stream is unchanged (base64 of the same bytes).
	code, events := sse(t, attachReq(t, sess, "?follow=0"))
	if code != 200 || len(events) < 2 {
		t.Fatalf("sse: %d %v", code, events)
	}

	// More than the journal holds (8 MiB): a reader from 0 gets a gap, then the rest.
	const total = 10<<20 + 3
	big, err := s.C.CreateSession(ctx(t), sb.ID, api.CreateSessionRequest{Command: "head -c 10485760 /dev/zero; printf END"})
	if err != nil {
		t.Fatal(err)
	}
	st, err := s.C.Attach(ctx(t), big, "") // starts it (before it answers); wait for the exit
	if err != nil {
		t.Fatal(err)
	}
	st.Close()
	s.Eventually(30*time.Second, "the big writer to exit", func() bool {
		p, err := s.C.GetProcess(ctx(t), sb.ID, big.PID)
		return err == nil && p.State == api.ProcExited
	})
	data, gaps, exit = output(t, frames(t, attachReq(t, big, "?encoding=frames")), 0)
	if len(gaps) != 1 || gaps[0].Dropped != total-int64(len(data)) || !bytes.HasSuffix(data, []byte("END")) ||
		exit.Offset != total || bytes.Count(data, []byte{0}) != len(data)-3 {
		t.Fatalf("big: %d bytes, gaps %v, exit %+v", len(data), gaps, exit)
	}
}
