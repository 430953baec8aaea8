package rest

import (
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"testing"
	"time"

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
