package rest

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
)

// serving runs Serve on a loopback listener with handler h and d; stop begins the
// drain, and the returned channel gets Serve's result.
func serving(t *testing.T, h http.Handler, d Drain) (url string, stop context.CancelFunc, served chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	t.Cleanup(stop)
	served = make(chan error, 1)
	go func() { served <- Serve(ctx, &http.Server{Handler: h}, ln, d) }()
	return "http://" + ln.Addr().String(), stop, served
}

// get sends a GET to url and delivers its answer (status and body) or its error.
func get(url string) chan string {
	out := make(chan string, 1)
	go func() {
		resp, err := http.Get(url)
		if err != nil {
			out <- "error: " + err.Error()
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		out <- fmt.Sprintf("%d %s", resp.StatusCode, b)
	}()
	return out
}

// waitRefused waits until url's listener refuses new connections (closed by a drain).
func waitRefused(t *testing.T, url string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", strings.TrimPrefix(url, "http://"), time.Second)
		if err != nil {
			return
		}
		c.Close()
		if time.Now().After(deadline) {
			t.Fatal("the listener still takes connections during the drain")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func within[T any](t *testing.T, ch chan T, d time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(d):
		t.Fatalf("%s: nothing after %v", what, d)
		var zero T
		return zero
	}
}

// TestDrainLetsRequestsFinish: when the stop begins, a request in flight goes on with
// a live context and gets its own answer; the listener takes no new connection; a
// stream whose client resumes it (EndAtStop) ends at once with ErrShuttingDown; Serve
// returns only once the request has answered.
func TestDrainLetsRequestsFinish(t *testing.T) {
	release := make(chan struct{})
	inFlight := make(chan struct{}, 2)
	streamEnded := make(chan bool, 1)
	mux := http.NewServeMux()
	mux.HandleFunc("/work", func(w http.ResponseWriter, r *http.Request) {
		inFlight <- struct{}{}
		select {
		case <-release:
		case <-r.Context().Done():
			http.Error(w, "ended early", http.StatusInternalServerError)
			return
		}
		fmt.Fprint(w, "done")
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		defer EndAtStop(r, cancel)()
		inFlight <- struct{}{}
		<-ctx.Done()
		streamEnded <- Stopping(ctx) && r.Context().Err() == nil
	})
	url, stop, served := serving(t, mux, Drain{Grace: time.Minute})
	work := get(url + "/work")
	stream := get(url + "/stream")
	within(t, inFlight, 10*time.Second, "first request")
	within(t, inFlight, 10*time.Second, "second request")
	stop()
	if !within(t, streamEnded, 10*time.Second, "resumable stream") {
		t.Fatal("the resumable stream's context did not end with ErrShuttingDown while its request lived on")
	}
	within(t, stream, 10*time.Second, "resumable stream's answer")
	waitRefused(t, url) // the listener is closed
	select {
	case err := <-served:
		t.Fatalf("Serve returned (%v) with a request in flight", err)
	default:
	}
	close(release)
	if got := within(t, work, 10*time.Second, "request in flight"); got != "200 done" {
		t.Fatalf("request in flight at the stop: %q, want its own answer", got)
	}
	if err := within(t, served, 10*time.Second, "Serve"); err != nil {
		t.Fatal(err)
	}
}

// TestDrainCutsAfterGrace: a request still in flight when the grace ends is answered
// 503 with Retry-After: 1 (its context ends with ErrShuttingDown), not taken for one
// whose client went away (until 2026-12-07 such a request got an empty 200).
func TestDrainCutsAfterGrace(t *testing.T) {
	for _, tc := range []struct {
		name  string
		grace time.Duration
		hurry bool
	}{
		{"grace", 200 * time.Millisecond, false},
		{"hurry", time.Hour, true}, // a second signal ends an hour's grace at once
	} {
		t.Run(tc.name, func(t *testing.T) {
			inFlight := make(chan struct{})
			h := Handle(slog.New(slog.DiscardHandler), func(w http.ResponseWriter, r *http.Request) error {
				close(inFlight)
				<-r.Context().Done()
				return fmt.Errorf("wait: %w", r.Context().Err())
			})
			hurry, hurryNow := context.WithCancel(context.Background())
			defer hurryNow()
			url, stop, served := serving(t, h, Drain{Grace: tc.grace, Hurry: hurry})
			answer := make(chan *http.Response, 1)
			go func() {
				resp, err := http.Get(url)
				if err != nil {
					t.Error(err)
				}
				answer <- resp
			}()
			<-inFlight
			stop()
			if tc.hurry {
				hurryNow()
			}
			resp := within(t, answer, 10*time.Second, "request in flight")
			if resp == nil {
				return
			}
			defer resp.Body.Close()
			var body api.Error
			if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || resp.StatusCode != http.StatusServiceUnavailable ||
				resp.Header.Get("Retry-After") != "1" || body.Error.Code != "unavailable" || !strings.Contains(body.Error.Message, "restarting") {
				t.Fatalf("a request in flight after the grace: %d Retry-After %q %+v %v", resp.StatusCode, resp.Header.Get("Retry-After"), body, err)
			}
			if err := within(t, served, 10*time.Second, "Serve"); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestDrainAnswersOnKeptConnections: for LameDuck after the stop began, a request a
// client sends on a keep-alive connection it holds is answered (with Connection:
// close), not lost with a connection closed under it.
func TestDrainAnswersOnKeptConnections(t *testing.T) {
	url, stop, served := serving(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { fmt.Fprint(w, "ok") }),
		Drain{Grace: time.Minute})
	c := &http.Client{Transport: &http.Transport{}}
	send := func() (reused bool, closed bool, err error) {
		trace := &httptrace.ClientTrace{GotConn: func(i httptrace.GotConnInfo) { reused = i.Reused }}
		req, _ := http.NewRequestWithContext(httptrace.WithClientTrace(context.Background(), trace), "GET", url, nil)
		resp, err := c.Do(req)
		if err != nil {
			return reused, false, err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if string(b) != "ok" {
			return reused, resp.Close, fmt.Errorf("answer %d %q", resp.StatusCode, b)
		}
		return reused, resp.Close, nil
	}
	if _, _, err := send(); err != nil {
		t.Fatal(err)
	}
	stop()
	// Once the listener is closed, the client's kept connection still takes a request.
	waitRefused(t, url)
	reused, closed, err := send()
	if err != nil || !reused || !closed {
		t.Fatalf("a request on a kept connection during the drain: reused %v, Connection: close %v, %v", reused, closed, err)
	}
	if err := within(t, served, 10*time.Second, "Serve"); err != nil {
		t.Fatal(err)
	}
}
