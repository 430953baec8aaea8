package e2e

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// TestExecRoute runs commands in a gVisor sandbox with one request each
// (POST /v1/sandboxes/{id}/exec): stdout, stderr and the exit status of a shell
// command as raw SSE events, 8 MiB of output byte-exact through the Go client, and
// `space exec`, which uses the route.
func TestExecRoute(t *testing.T) {
	s := start(t, options{})
	sb := s.create(t, api.CreateSandboxRequest{})
	c := ctx(t, 2*time.Minute)

	req, _ := http.NewRequestWithContext(c, "POST", s.URL+"/v1/sandboxes/"+sb.ID+"/exec",
		strings.NewReader(`{"argv":["sh","-c","echo out; echo err >&2; exit 3"]}`))
	req.Header.Set("Authorization", "Bearer "+s.Key)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("exec: %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	got := map[string]string{}
	var name string
	var exit api.ExitEvent
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "event: "):
			name = l[7:]
		case strings.HasPrefix(l, "data: ") && (name == api.EventStdout || name == api.EventStderr):
			var o api.OutputEvent
			if err := json.Unmarshal([]byte(l[6:]), &o); err != nil {
				t.Fatal(err)
			}
			b, _ := base64.StdEncoding.DecodeString(o.Data)
			got[name] += string(b)
		case strings.HasPrefix(l, "data: ") && name == api.EventExit:
			if err := json.Unmarshal([]byte(l[6:]), &exit); err != nil {
				t.Fatal(err)
			}
		}
	}
	if got["stdout"] != "out\n" || got["stderr"] != "err\n" || exit.ExitCode == nil || *exit.ExitCode != 3 || exit.Offset != 8 {
		t.Fatalf("output %q, exit %+v", got, exit)
	}

	// 8 MiB arrive byte-exact.
	out, _, code := s.exec(t, sb.ID, "sh", "-c", "head -c 8388608 /dev/urandom >/tmp/r && sha256sum </tmp/r")
	if code != 0 || len(out) < 64 {
		t.Fatalf("make data: %d %q", code, out)
	}
	var data bytes.Buffer
	x, err := s.C.Run(c, sb.ID, api.ExecRequest{Argv: []string{"cat", "/tmp/r"}}, client.Output{Stdout: &data})
	if err != nil || x.ExitCode == nil || *x.ExitCode != 0 {
		t.Fatalf("cat: %+v %v", x, err)
	}
	sum := sha256.Sum256(data.Bytes())
	if data.Len() != 8<<20 || hex.EncodeToString(sum[:]) != out[:64] {
		t.Fatalf("got %d bytes with sha256 %x, want 8 MiB with %s", data.Len(), sum, out[:64])
	}

	// A timeout's kill says so in the exit event, on the one-request route and a session.
	x, err = s.C.Run(c, sb.ID, api.ExecRequest{Argv: []string{"sleep", "60"}, Timeout: "500ms"}, client.Output{})
	if err != nil || !x.TimedOut || x.Signal != "SIGKILL" {
		t.Fatalf("exec past its timeout: %+v %v", x, err)
	}
	procs, err := s.C.ListProcesses(c, sb.ID)
	if err != nil {
		t.Fatal(err)
	}
	if i := slices.IndexFunc(procs, func(p api.Process) bool { return p.TimedOut }); i < 0 || procs[i].Signal != "SIGKILL" || procs[i].Argv[0] != "sleep" {
		t.Fatalf("the timed-out process is not listed as such: %+v", procs)
	}
	sess, err := s.C.CreateSession(c, sb.ID, api.CreateSessionRequest{Argv: []string{"sleep", "60"}, Timeout: "500ms"})
	if err != nil {
		t.Fatal(err)
	}
	if x, err = s.C.Follow(c, sess, client.Output{}); err != nil || !x.TimedOut {
		t.Fatalf("session past its timeout: %+v %v", x, err)
	}

	// The CLI.
	stdout, stderr, code := s.cli(t, "exec", sb.ID, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
	if stdout != "out\n" || stderr != "err\n" || code != 3 {
		t.Fatalf("space exec: %q %q %d", stdout, stderr, code)
	}
}
