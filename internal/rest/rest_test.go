package rest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
)

// TestWriteErrorRetryAfter: an error that passes on its own carries Retry-After in
// whole seconds (rounded up); a rate limit says 1 s; other errors none.
func TestWriteErrorRetryAfter(t *testing.T) {
	for _, tc := range []struct {
		err    error
		status int
		want   string
	}{
		{fault.Later(fault.New(fault.Conflict, "busy"), time.Second), 409, "1"},
		{fault.Later(fault.New(fault.Conflict, "busy"), 1500*time.Millisecond), 409, "2"},
		{fmt.Errorf("wrapped: %w", fault.Later(fault.New(fault.Conflict, "busy"), time.Second)), 409, "1"},
		{fault.New(fault.TooManyRequests, "slow down"), 429, "1"},
		{fault.New(fault.Conflict, "no"), 409, ""},
		{errors.New("boom"), 500, ""},
	} {
		w := httptest.NewRecorder()
		WriteError(w, httptest.NewRequest("POST", "/x", nil), slog.New(slog.DiscardHandler), tc.err)
		if w.Code != tc.status || w.Header().Get("Retry-After") != tc.want {
			t.Errorf("%v: %d, Retry-After %q; want %d, %q", tc.err, w.Code, w.Header().Get("Retry-After"), tc.status, tc.want)
		}
	}
}

// TestShuttingDownAnswers503: a request in flight when its server stops (its context
// ends with ErrShuttingDown, BaseContext) is answered 503 with Retry-After: 1, not taken
// for one whose client went away.
func TestShuttingDownAnswers503(t *testing.T) {
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	inFlight := make(chan struct{})
	srv := httptest.NewUnstartedServer(Handle(slog.New(slog.DiscardHandler), func(w http.ResponseWriter, r *http.Request) error {
		close(inFlight)
		<-r.Context().Done()
		return fmt.Errorf("wait: %w", r.Context().Err())
	}))
	srv.Config.BaseContext = func(net.Listener) context.Context { return BaseContext(ctx) }
	srv.Start()
	defer srv.Close()
	answer := make(chan *http.Response, 1)
	go func() {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Error(err)
		}
		answer <- resp
	}()
	<-inFlight
	stop()
	resp := <-answer
	if resp == nil {
		return
	}
	defer resp.Body.Close()
	var body api.Error
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil || resp.StatusCode != http.StatusServiceUnavailable ||
		resp.Header.Get("Retry-After") != "1" || body.Error.Code != "unavailable" || !strings.Contains(body.Error.Message, "restarting") {
		t.Fatalf("a request in flight at shutdown: %d Retry-After %q %+v %v", resp.StatusCode, resp.Header.Get("Retry-After"), body, err)
	}
}
