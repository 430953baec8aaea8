package server_test

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/spacetest"
)

// TestExecFrames runs a command through POST /v1/sandboxes/{id}/exec in the frames
// encoding (by Accept, and by ?encoding=frames): the start frame names the process, the
// output frames carry the bytes as written (not UTF-8, NUL included) at chaining
// offsets, the exit frame comes last with the status and the final offset.
func TestExecFrames(t *testing.T) {
	s := spacetest.Start(t, spacetest.Options{})
	sb := s.Create(api.CreateSandboxRequest{})
	want := []byte{0xff, 0, 'x', 0xfe, '\n'}
	for _, how := range []struct{ query, accept string }{
		{"", api.FramesContentType + ", text/event-stream;q=0.5"},
		{"?encoding=frames", ""},
	} {
		req, err := http.NewRequest("POST", s.URL+"/v1/sandboxes/"+sb.ID+"/exec"+how.query,
			strings.NewReader(`{"command":"printf '\\377\\000x\\376\\n'; exit 9"}`))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Authorization", "Bearer "+s.AdminKey)
		if how.accept != "" {
			req.Header.Set("Accept", how.accept)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != api.FramesContentType {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Fatalf("%+v: %d %s %s", how, resp.StatusCode, resp.Header.Get("Content-Type"), b)
		}
		br := bufio.NewReader(resp.Body)
		var types []byte
		var out []byte
		var start api.StartEvent
		var exit api.ExitEvent
		for {
			var h [api.FrameHeaderSize]byte
			if _, err := io.ReadFull(br, h[:]); err == io.EOF {
				break
			} else if err != nil {
				t.Fatal(err)
			}
			off := int64(binary.BigEndian.Uint64(h[1:9]))
			payload := make([]byte, binary.BigEndian.Uint32(h[9:13]))
			if _, err := io.ReadFull(br, payload); err != nil {
				t.Fatal(err)
			}
			types = append(types, h[0])
			switch h[0] {
			case api.FrameStart:
				_ = json.Unmarshal(payload, &start)
			case api.FrameStdout:
				if off != int64(len(out)) {
					t.Fatalf("%+v: output frame at %d after %d bytes", how, off, len(out))
				}
				out = append(out, payload...)
			case api.FrameExit:
				_ = json.Unmarshal(payload, &exit)
			}
		}
		resp.Body.Close()
		if len(types) < 3 || types[0] != api.FrameStart || types[len(types)-1] != api.FrameExit || start.PID <= 0 || start.ProcessUID == "" ||
			!bytes.Equal(out, want) || exit.ExitCode == nil || *exit.ExitCode != 9 || exit.Offset != int64(len(want)) {
			t.Fatalf("%+v: frames %v start %+v output %q exit %+v", how, types, start, out, exit)
		}
	}
}
