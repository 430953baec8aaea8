package agent

import (
	"bytes"
	"testing"
	"time"
)

// appendAsync appends p in a goroutine; the channel closes when it returned.
func appendAsync(j *journal, p []byte) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		j.append(1, p)
		close(done)
	}()
	return done
}

// waitHeld waits (with a deadline) until an append is waiting for a follower.
func waitHeld(t *testing.T, j *journal) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		j.mu.Lock()
		held := j.advanced != nil
		j.mu.Unlock()
		if held {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the append did not wait for the follower")
		}
		time.Sleep(time.Millisecond)
	}
}

func waitDone(t *testing.T, done <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: the append still waits", what)
	}
}

// A follower that keeps up gets every byte: an append that would evict bytes it has
// not taken waits until it takes them.
func TestJournalWaitsForFollower(t *testing.T) {
	j := newJournal(64<<10, nil)
	j.stall = time.Hour
	f := j.follow(0)
	all := bytes.Repeat([]byte("0123456789abcdef"), 8<<10) // 128 KiB
	j.append(1, all[:64<<10])                              // fills the journal, evicts nothing
	done := appendAsync(j, all[64<<10:80<<10])
	waitHeld(t, j)
	if first, end := j.bounds(); first != 0 || end != 64<<10 {
		t.Fatalf("while held: bounds %d..%d", first, end)
	}
	var got []byte
	buf := make([]byte, 16<<10)
	_, n, gap := f.readAt(0, buf) // takes 16 KiB: room for the waiting append
	got = append(got, buf[:n]...)
	waitDone(t, done, "after the follower took 16 KiB")
	done = appendAsync(j, all[80<<10:])
	for pos := int64(n); pos < int64(len(all)) && gap == 0; {
		_, n, gap = f.readAt(pos, buf)
		got = append(got, buf[:n]...)
		pos += int64(n)
	}
	waitDone(t, done, "after the follower read on")
	if gap != 0 || !bytes.Equal(got, all) {
		t.Fatalf("follower: gap %d, %d bytes of %d", gap, len(got), len(all))
	}
}

// A follower that stops taking bytes holds the writer back for stall at most, then
// gets a gap; one that leaves releases the writer at once.
func TestJournalStalledFollower(t *testing.T) {
	j := newJournal(4096, nil)
	j.stall = 200 * time.Millisecond
	// The stall is counted from when the follower last kept up, which is before the
	// append that waits: measured from the second append it came up 0.14 ms short once.
	start := time.Now()
	f := j.follow(0)
	j.append(1, make([]byte, 4096))
	j.append(1, make([]byte, 1024)) // f never reads: waits out the stall
	if d := time.Since(start); d < j.stall {
		t.Fatalf("append went on after %v, before the follower stalled", d)
	}
	if _, _, gap := f.readAt(0, make([]byte, 10)); gap != 1024 {
		t.Fatalf("stalled follower: gap %d, want 1024", gap)
	}

	f.close()
	j.stall = time.Hour
	g := j.follow(5120) // caught up
	done := appendAsync(j, make([]byte, 4096))
	waitDone(t, done, "a caught-up follower's first 4 KiB") // fits: nothing it owes is evicted
	done = appendAsync(j, make([]byte, 1))
	waitHeld(t, j)
	g.close()
	waitDone(t, done, "after the follower closed")
}

// A follower caught up for longer than stall is not stalled: the next burst waits for
// it (its clock starts when the burst makes it fall behind).
func TestJournalIdleFollowerKeepsUp(t *testing.T) {
	j := newJournal(4096, nil)
	j.stall = 300 * time.Millisecond
	f := j.follow(0)
	f.seen = time.Now().Add(-time.Hour) // idle, caught up, for an hour
	j.append(1, make([]byte, 4096))
	done := appendAsync(j, make([]byte, 100))
	waitHeld(t, j)
	if _, n, gap := f.readAt(0, make([]byte, 4096)); n != 4096 || gap != 0 {
		t.Fatalf("read %d, gap %d", n, gap)
	}
	waitDone(t, done, "after the follower read")
	f.close()
}
