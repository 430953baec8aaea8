package rest

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Drain is how a server stops (Serve).
type Drain struct {
	// Grace is how long the requests in flight when the stop begins may go on.
	Grace time.Duration
	// Hurry, when it ends during the grace, ends the grace at once (an operator's
	// second SIGTERM or Ctrl-C).
	Hurry context.Context
	// Log is told when the stop waits for requests and when the grace runs out.
	Log *slog.Logger
}

// CutWait bounds how long requests whose contexts were ended (ErrShuttingDown) get to
// write their answers (a 503, a stream's last event) before their connections close.
const CutWait = 5 * time.Second

// drainKey is the request-context key of the context that ends when the drain begins
// (EndAtStop).
type drainKey struct{}

// Serve serves ln with srv until stop ends, then drains srv and returns once the drain
// is over, so that its caller stops what requests depend on (the node, the database)
// only after it:
//
//  1. ln closes: no new connection is taken (a socket passed by systemd keeps queueing
//     them for the next process). For up to LameDuck, a request that comes on a
//     connection a client keeps open is still answered, with "Connection: close"; then
//     the idle connections close.
//  2. Streams whose clients resume them by themselves, and feeds that never end, end at
//     once (their handlers called EndAtStop), so that their clients reconnect to the
//     next process.
//  3. Every other request in flight goes on until it ends, d.Grace passes or d.Hurry
//     closes; a connection closes after its answer.
//  4. The contexts of the requests left end with ErrShuttingDown (they answer 503 with
//     Retry-After, or end their streams), and after up to CutWait the connections left
//     are closed.
//
// Serve sets srv.BaseContext, and wraps srv.Handler and srv.ConnState to follow the
// requests and connections in flight.
func Serve(stop context.Context, srv *http.Server, ln net.Listener, d Drain) error {
	log := d.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// Request contexts live past stop: they end (cut) only after the grace.
	life, cut := context.WithCancelCause(context.WithoutCancel(stop))
	draining, drainNow := context.WithCancelCause(life)
	var inFlight sync.Map   // *http.Request → struct{}: the requests being served
	var closing atomic.Bool // the drain closed ln
	h := srv.Handler
	if h == nil {
		h = http.DefaultServeMux
	}
	srv.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		inFlight.Store(r, struct{}{})
		defer inFlight.Delete(r)
		if closing.Load() {
			w.Header().Set("Connection", "close") // the client's pool drops it after this answer
		}
		h.ServeHTTP(w, r)
	})
	var open atomic.Int64 // connections not yet closed or hijacked
	connState := srv.ConnState
	srv.ConnState = func(c net.Conn, st http.ConnState) {
		switch st {
		case http.StateNew:
			open.Add(1)
		case http.StateClosed, http.StateHijacked:
			open.Add(-1)
		}
		if connState != nil {
			connState(c, st)
		}
	}
	srv.BaseContext = func(net.Listener) context.Context {
		return context.WithValue(life, drainKey{}, draining)
	}

	served := make(chan struct{}) // Serve returned by itself (a listener error)
	done := make(chan struct{})
	go func() {
		defer close(done)
		select {
		case <-stop.Done():
		case <-served:
			cut(ErrShuttingDown)
			return
		}
		drainNow(ErrShuttingDown)
		closing.Store(true)
		_ = ln.Close() // no new connection: Serve returns
		if n, some := requests(&inFlight); n > 0 {
			log.Info("stopping: requests in flight may finish", "requests", n, "grace", d.Grace, "listen", ln.Addr().String(), "some", some)
		}
		hurry := d.Hurry
		if hurry == nil {
			hurry = context.Background()
		}
		gctx, cancel := context.WithTimeout(hurry, d.Grace)
		lameDuck(gctx, &open)
		err := srv.Shutdown(gctx)
		cancel()
		// Hijacked connections (a sandbox port's WebSocket) are not waited for by
		// Shutdown: they end here, with every request left after the grace.
		cut(ErrShuttingDown)
		if err == nil {
			return
		}
		n, some := requests(&inFlight)
		log.Warn("stopping: the grace ran out; requests still in flight are answered 503 or cut",
			"requests", n, "grace", d.Grace, "listen", ln.Addr().String(), "some", some)
		cctx, cancel := context.WithTimeout(context.Background(), CutWait)
		defer cancel()
		if srv.Shutdown(cctx) != nil {
			_ = srv.Close()
		}
	}()
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) || closing.Load() {
		<-done
		return nil
	}
	close(served)
	<-done
	_ = srv.Close()
	return err
}

// LameDuck bounds how long a stop keeps the connections that clients hold open
// (keep-alive) before it closes the idle ones: see lameDuck.
const LameDuck = time.Second

// lameDuck waits up to LameDuck (or until ctx ends) for the open connections to close.
// Meanwhile a request that comes on one is still answered, with "Connection: close".
// Closing an idle keep-alive connection at once (what http.Server.Shutdown does) races
// with a client that is sending its next request on it: the request is lost with the
// connection, and a client retries no POST (an E2B SDK's create failed so, "fetch
// failed", 3 times in 573 operations under 8 restarts); a client that used its
// connection in the last second has dropped it after that answer.
func lameDuck(ctx context.Context, open *atomic.Int64) {
	deadline := time.NewTimer(LameDuck)
	defer deadline.Stop()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for open.Load() > 0 {
		select {
		case <-ctx.Done():
			return
		case <-deadline.C:
			return
		case <-tick.C:
		}
	}
}

// requests counts the requests in inFlight and names a few (method and path), for the
// log of a stop.
func requests(inFlight *sync.Map) (n int, some []string) {
	inFlight.Range(func(k, _ any) bool {
		n++
		if len(some) < 5 {
			r := k.(*http.Request)
			some = append(some, r.Method+" "+r.URL.Path)
		}
		return true
	})
	return n, some
}

// EndAtStop ends a stream when its server begins to stop (Serve) instead of letting
// it hold the stop for its grace: it calls cancel(ErrShuttingDown) then (at once if
// the stop has begun). It is for streams whose client resumes them by itself (an
// attach or exec stream from Last-Event-ID, the event feed, a followed network log)
// and feeds that never end by themselves (a file watch), so that their clients
// reconnect to the next process at once. A handler calls it once its stream has
// begun (what it did before that gets the grace) and calls the returned stop when
// the stream ends. Outside Serve it does nothing.
func EndAtStop(r *http.Request, cancel context.CancelCauseFunc) (stop func() bool) {
	draining, ok := r.Context().Value(drainKey{}).(context.Context)
	if !ok {
		return func() bool { return false }
	}
	return context.AfterFunc(draining, func() { cancel(ErrShuttingDown) })
}

// Stopping reports whether ctx ended because its server is stopping (Serve,
// EndAtStop), not because its client went away.
func Stopping(ctx context.Context) bool {
	return ctx.Err() != nil && errors.Is(context.Cause(ctx), ErrShuttingDown)
}
