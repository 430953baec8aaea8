package node

import (
	"testing"
	"time"
)

// An agent is asked for its output activity often enough for its sandbox's idle
// timeout, and no more: each question wakes the sandbox.
func TestActivityEvery(t *testing.T) {
	for _, c := range []struct {
		idle, want time.Duration
	}{
		{time.Second, activityPoll},      // short timeouts: every poll
		{40 * time.Second, activityPoll}, // 5 % of 40 s
		{10 * time.Minute, 30 * time.Second},
		{6 * time.Hour, maxActivityPoll}, // the default, 6 h: once a minute
		{0, maxActivityPoll},             // never suspended
	} {
		if got := activityEvery(c.idle); got != c.want {
			t.Errorf("activityEvery(%s) = %s, want %s", c.idle, got, c.want)
		}
	}
}
