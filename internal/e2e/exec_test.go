package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// TestExecRoute runs commands in a gVisor sandbox with one request each
// (POST /v1/sandboxes/{id}/exec): stdout, stderr and the exit status of a shell
// command as raw SSE events, 8 MiB of output byte-exact through the Go client, and
// `space exec`, which uses the route, and 96 commands at once in the one sandbox, half
// of them through command sessions, each stream byte-exact.
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

	// A command sent again with its Idempotency-Key after a suspend and a wake (the
	// agent keeps the key with the process across the checkpoint) streams the process
	// the first request started and runs nothing again.
	keyed := func() (string, string) {
		t.Helper()
		req, _ := http.NewRequestWithContext(c, "POST", s.URL+"/v1/sandboxes/"+sb.ID+"/exec?encoding=text",
			strings.NewReader(`{"command":"echo run >> /tmp/keyed-runs; wc -l < /tmp/keyed-runs"}`))
		req.Header.Set("Authorization", "Bearer "+s.Key)
		req.Header.Set("Idempotency-Key", "e2e-keyed")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("keyed exec: %d %s", resp.StatusCode, b)
		}
		start, _, _ := strings.Cut(string(b), "\n\n")
		return start, string(b)
	}
	start1, body1 := keyed()
	for _, v := range []string{api.OpSuspend, api.OpWake} {
		if _, err := s.C.LifecycleAndWait(c, sb.ID, v); err != nil {
			t.Fatal(err)
		}
	}
	start2, body2 := keyed()
	if start2 != start1 || body2 != body1 || !strings.Contains(body1, `"text":"1\n"`) {
		t.Fatalf("keyed exec after a suspend and wake: %q, first %q", body2, body1)
	}
	if out, _, _ := s.exec(t, sb.ID, "cat", "/tmp/keyed-runs"); out != "run\n" {
		t.Fatalf("the keyed command ran %q", out)
	}

	// Many commands at once, as an agent framework runs them: every stream is whole and
	// its own (a burst is also what makes the node ask the agent for many connections
	// at once).
	const burst = 96
	var wg sync.WaitGroup
	errs := make(chan error, burst)
	for i := 1; i <= burst; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- concurrentExec(c, s, sb.ID, i)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
}

// concurrentExec runs `seq` with i's own length and exit code, through the one-request
// route for odd i and a command session for even i, and checks its output and status.
func concurrentExec(c context.Context, s *srv, id string, i int) error {
	lines := 300 * i
	argv := []string{"sh", "-c", fmt.Sprintf("seq 1 %d; echo e%d >&2; exit %d", lines, i, i%7)}
	var out, errOut bytes.Buffer
	o := client.Output{Stdout: &out, Stderr: &errOut}
	var x *api.ExitEvent
	var err error
	if i%2 == 1 {
		x, err = s.C.Run(c, id, api.ExecRequest{Argv: argv}, o)
	} else {
		var sess *api.CommandSession
		if sess, err = s.C.CreateSession(c, id, api.CreateSessionRequest{Argv: argv}); err == nil {
			x, err = s.C.Follow(c, sess, o)
		}
	}
	if err != nil {
		return fmt.Errorf("command %d: %w", i, err)
	}
	var want strings.Builder
	for n := 1; n <= lines; n++ {
		want.WriteString(strconv.Itoa(n))
		want.WriteByte('\n')
	}
	if out.String() != want.String() || errOut.String() != fmt.Sprintf("e%d\n", i) ||
		x.ExitCode == nil || *x.ExitCode != i%7 {
		return fmt.Errorf("command %d: %d bytes of stdout (want %d, equal %v), stderr %q, exit %+v",
			i, out.Len(), want.Len(), out.String() == want.String(), errOut.String(), x)
	}
	return nil
}
