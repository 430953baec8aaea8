package node

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/artifact"
	"github.com/spacedev/space/internal/store"
)

// closedWithin reports whether ch is closed within d.
func closedWithin(ch <-chan struct{}, d time.Duration) bool {
	select {
	case <-ch:
		return true
	case <-time.After(d):
		return false
	}
}

// underWay passes g as a request does and marks its body sent; the returned func ends
// its flight.
func underWay(ctx context.Context, g *gate) (func(), error) {
	f := &flight{g: g}
	if err := g.enter(ctx, f, true); err != nil {
		return nil, err
	}
	return f.answered, nil
}

// TestGateHoldWaitsForRequestsUnderWay: a pause begins only once the requests that
// passed the gate before it are answered, and requests that come during it wait until
// it ends.
func TestGateHoldWaitsForRequestsUnderWay(t *testing.T) {
	var g gate
	ctx := context.Background()
	done, err := underWay(ctx, &g)
	if err != nil {
		t.Fatal(err)
	}
	held := make(chan func())
	go func() { held <- g.hold(ctx) }()
	select {
	case <-held:
		t.Fatal("the pause began while a request was under way")
	case <-time.After(50 * time.Millisecond):
	}
	done()
	var release func()
	select {
	case release = <-held:
	case <-time.After(5 * time.Second):
		t.Fatal("the pause did not begin once the request was answered")
	}
	// A request during the pause waits for its end.
	passed := make(chan struct{})
	go func() {
		d, err := underWay(ctx, &g)
		if err == nil {
			d()
		}
		close(passed)
	}()
	if closedWithin(passed, 50*time.Millisecond) {
		t.Fatal("a request passed a closed gate")
	}
	release()
	release() // a second call is harmless
	if !closedWithin(passed, 5*time.Second) {
		t.Fatal("the waiting request did not go on when the pause ended")
	}
}

// TestGateNestedHolds: the gate opens when the last of nested pauses ends.
func TestGateNestedHolds(t *testing.T) {
	var g gate
	ctx := context.Background()
	outer := g.hold(ctx)
	inner := g.hold(ctx)
	passed := make(chan struct{})
	go func() {
		if d, err := underWay(ctx, &g); err == nil {
			d()
		}
		close(passed)
	}()
	inner()
	if closedWithin(passed, 50*time.Millisecond) {
		t.Fatal("the gate opened while the outer pause went on")
	}
	outer()
	if !closedWithin(passed, 5*time.Second) {
		t.Fatal("the gate did not open after the outer pause")
	}
	// And it closes again for the next pause.
	next := g.hold(ctx)
	defer next()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	if _, err := underWay(wctx, &g); err == nil {
		t.Fatal("a request passed the gate of a second pause")
	}
}

// TestGateHoldBoundedByContext: a pause waits for requests under way only as long as
// its context allows.
func TestGateHoldBoundedByContext(t *testing.T) {
	var g gate
	if _, err := underWay(context.Background(), &g); err != nil { // never answered
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	held := make(chan func())
	go func() { held <- g.hold(ctx) }()
	select {
	case release := <-held:
		release()
	case <-time.After(drainTimeout - time.Second):
		t.Fatal("the pause waited past its context")
	}
}

// TestGatedTransportCountsUntilHeaders: through the gated transport a request counts
// as under way until its answer's headers arrive, not while its body streams.
func TestGatedTransportCountsUntilHeaders(t *testing.T) {
	answer := make(chan struct{})
	body := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-answer
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		<-body
		_, _ = io.WriteString(w, "end")
	}))
	defer srv.Close()
	defer close(body)
	var g gate
	hc := &http.Client{Transport: &gatedTransport{g: &g, inner: http.DefaultTransport}}
	got := make(chan *http.Response, 1)
	go func() {
		resp, err := hc.Get(srv.URL)
		if err != nil {
			t.Error(err)
			close(got)
			return
		}
		got <- resp
	}()
	waitUnderWay(t, &g, 1)
	held := make(chan func(), 1)
	pauseWaitsFor(t, &g, held, answer)
	if resp := <-got; resp != nil {
		_ = resp.Body.Close()
	}
}

// stallingTransport stands for a transport that has not yet sent the request (a
// connection being dialled): it tells entered, then waits for go_ before it reads the
// body and answers.
type stallingTransport struct {
	entered chan struct{}
	go_     chan struct{}
}

func (t *stallingTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	close(t.entered)
	<-t.go_
	if req.Body != nil {
		_, _ = io.Copy(io.Discard, req.Body)
		_ = req.Body.Close()
	}
	return &http.Response{StatusCode: http.StatusNoContent, Body: http.NoBody, Request: req}, nil
}

// TestGatedTransportCountsFromThePass: a request whose body is in memory (the data
// plane's JSON: a process start) is under way from when it passes the gate, not only
// once its body is sent. Counted late, a pause could drain in between and quiesce the
// agent while the start was still on its way to it, and the process it started ran
// through the checkpoint (gVisor then failed to save the listener the process's fork
// held).
func TestGatedTransportCountsFromThePass(t *testing.T) {
	const spec = `{"argv":["true"]}`
	for name, body := range map[string]func() (io.Reader, int64){
		"in memory": func() (io.Reader, int64) { return strings.NewReader(spec), -1 },
		// A relayed envd call: a short body of declared length that is not replayable.
		"short": func() (io.Reader, int64) { return io.NopCloser(strings.NewReader(spec)), int64(len(spec)) },
	} {
		t.Run(name, func(t *testing.T) {
			var g gate
			st := &stallingTransport{entered: make(chan struct{}), go_: make(chan struct{})}
			hc := &http.Client{Transport: &gatedTransport{g: &g, inner: st}}
			got := make(chan error, 1)
			go func() {
				r, n := body()
				req, err := http.NewRequest(http.MethodPost, "http://agent/v1/exec", r)
				if err != nil {
					got <- err
					return
				}
				if n >= 0 {
					req.ContentLength = n
				}
				resp, err := hc.Do(req)
				if err == nil {
					_ = resp.Body.Close()
				}
				got <- err
			}()
			<-st.entered // past the gate, its body not sent yet
			held := make(chan func(), 1)
			pauseWaitsFor(t, &g, held, st.go_)
			if err := <-got; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestCheckpointDueCountsFromAMove: a sandbox's next periodic checkpoint is an interval
// after its last one, or after it moved to this node if that came later (a sandbox
// restored from its last checkpoint is as recent as the move).
func TestCheckpointDueCountsFromAMove(t *testing.T) {
	n := &Node{cfg: Config{Artifacts: &artifact.Client{}}, stopping: make(chan struct{})}
	close(n.stopping) // a kick from kickAt does nothing
	ago := func(d time.Duration) *time.Time { at := time.Now().Add(-d); return &at }
	sb := func(checkpointAt, movedAt *time.Time) *store.Sandbox {
		return &store.Sandbox{
			ID: "sb-test", State: api.StateRunning, DesiredState: api.StateRunning, TemplateDigest: "sha256:x",
			Spec: store.SandboxSpec{CheckpointInterval: 60}, StatusChangedAt: ago(time.Hour),
			CheckpointAt: checkpointAt, MovedAt: movedAt,
		}
	}
	for _, c := range []struct {
		name                  string
		checkpointAt, movedAt *time.Time
		want                  bool
	}{
		{"never checkpointed, running an hour", nil, nil, true},
		{"checkpointed two minutes ago", ago(2 * time.Minute), nil, true},
		{"checkpointed half a minute ago", ago(30 * time.Second), nil, false},
		{"restored from a checkpoint two minutes old, a second ago", ago(2 * time.Minute), ago(time.Second), false},
		{"moved two minutes ago", ago(3 * time.Minute), ago(2 * time.Minute), true},
	} {
		if got := n.checkpointDue(sb(c.checkpointAt, c.movedAt)); got != c.want {
			t.Errorf("%s: due %v, want %v", c.name, got, c.want)
		}
	}
}

// TestGatedTransportIgnoresStreamingBodies: a request still sending its body (stdin
// streamed for as long as its client likes) does not hold a pause back; once its body
// is all sent it is under way until its answer begins.
func TestGatedTransportIgnoresStreamingBodies(t *testing.T) {
	answer := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		<-answer
		w.WriteHeader(http.StatusNoContent)
	}))
	defer srv.Close()
	var g gate
	hc := &http.Client{Transport: &gatedTransport{g: &g, inner: http.DefaultTransport}}
	pr, pw := io.Pipe()
	got := make(chan error, 1)
	go func() {
		resp, err := hc.Post(srv.URL, "application/octet-stream", pr)
		if err == nil {
			_ = resp.Body.Close()
		}
		got <- err
	}()
	if _, err := pw.Write([]byte("some input")); err != nil { // the server has read it
		t.Fatal(err)
	}
	held := make(chan func(), 1)
	go func() { held <- g.hold(context.Background()) }()
	select {
	case release := <-held:
		release()
	case <-time.After(drainTimeout - time.Second):
		t.Fatal("a pause waited for a request still sending its body")
	}
	_ = pw.Close()
	// Now its body is sent: the next pause waits for its answer.
	waitUnderWay(t, &g, 1)
	pauseWaitsFor(t, &g, held, answer)
	if err := <-got; err != nil {
		t.Fatal(err)
	}
}

// waitUnderWay waits until n requests are under way at g.
func waitUnderWay(t *testing.T, g *gate, n int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		g.mu.Lock()
		got := g.inflight
		g.mu.Unlock()
		if got == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d requests under way, want %d", got, n)
		}
		time.Sleep(time.Millisecond)
	}
}

// pauseWaitsFor checks that a pause of g begins only once answer is closed (it closes
// it).
func pauseWaitsFor(t *testing.T, g *gate, held chan func(), answer chan struct{}) {
	t.Helper()
	go func() { held <- g.hold(context.Background()) }()
	select {
	case <-held:
		t.Fatal("the pause began before the answer did")
	case <-time.After(50 * time.Millisecond):
	}
	close(answer)
	select {
	case release := <-held:
		release()
	case <-time.After(5 * time.Second):
		t.Fatal("the pause did not begin once the answer had")
	}
}
