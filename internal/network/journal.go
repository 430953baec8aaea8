package network

import (
	"context"
	"sync"
	"time"

	"github.com/spacedev/space/api"
)

// Journal is a sandbox's bounded egress audit log: events addressed by absolute offsets
// (0 = the first event ever), the oldest dropped when the bound is reached. Readers
// replay from an offset and follow; a reader behind the oldest kept event learns how
// many it missed (gap), like the process output journals of the data plane.
//
// Hand-rolled: a ring of structs with absolute offsets and a change channel is a few
// dozen lines, and no library offers that shape.
type Journal struct {
	mu     sync.Mutex
	buf    []api.NetworkEvent
	first  int64 // offset of the oldest kept event
	end    int64 // offset one past the newest
	notify chan struct{}
	closed bool

	// Folding of repeated denied attempts: at most one event per key and second; the
	// next one carries the count of those folded.
	fold map[foldKey]*foldState
}

type foldKey struct {
	kind, reason, proto, dst, domain string
}

type foldState struct {
	last   time.Time
	folded int
}

// NewJournal returns a journal that keeps the last n events.
func NewJournal(n int) *Journal {
	return &Journal{buf: make([]api.NetworkEvent, n), fold: map[foldKey]*foldState{}}
}

// Append records ev (its Offset is set) and returns its offset, or -1 when it was folded
// into a later event.
func (j *Journal) Append(ev api.NetworkEvent) int64 {
	if ev.Time.IsZero() {
		ev.Time = time.Now()
	}
	j.mu.Lock()
	if j.closed {
		j.mu.Unlock()
		return -1
	}
	if ev.Verdict == api.NetDenied {
		k := foldKey{ev.Kind, ev.Reason, ev.Protocol, ev.Destination, ev.Domain}
		st := j.fold[k]
		if st != nil && ev.Time.Sub(st.last) < time.Second {
			st.folded++
			j.mu.Unlock()
			return -1
		}
		if st == nil {
			if len(j.fold) > 1024 {
				j.fold = map[foldKey]*foldState{}
			}
			st = &foldState{}
			j.fold[k] = st
		}
		ev.Count = 1 + st.folded
		st.last, st.folded = ev.Time, 0
	}
	ev.Offset = j.end
	j.buf[j.end%int64(len(j.buf))] = ev
	j.end++
	if j.end-j.first > int64(len(j.buf)) {
		j.first = j.end - int64(len(j.buf))
	}
	ch := j.notify
	j.notify = nil
	j.mu.Unlock()
	if ch != nil {
		close(ch)
	}
	return ev.Offset
}

// Bounds returns the offset of the oldest kept event and one past the newest.
func (j *Journal) Bounds() (first, end int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.first, j.end
}

// Read returns up to max events from offset from. gap > 0 says that many events were
// dropped before from could be read (the events returned start at from+gap).
func (j *Journal) Read(from int64, max int) (evs []api.NetworkEvent, gap int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	if from < j.first {
		gap = j.first - from
		from = j.first
	}
	for o := from; o < j.end && len(evs) < max; o++ {
		evs = append(evs, j.buf[o%int64(len(j.buf))])
	}
	return evs, gap
}

// Changed returns a channel closed at the next append or at close. Take it before
// reading, so that no event is missed.
func (j *Journal) Changed() <-chan struct{} {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.notify == nil {
		j.notify = make(chan struct{})
		if j.closed {
			close(j.notify)
		}
	}
	return j.notify
}

// Closed reports whether the journal has ended (its sandbox's networking is gone).
func (j *Journal) Closed() bool {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.closed
}

// Close ends the journal: followers return once they have read what it holds. The
// Manager closes a sandbox's journal when it tears its network down.
func (j *Journal) Close() { j.close() }

func (j *Journal) close() {
	j.mu.Lock()
	j.closed = true
	ch := j.notify
	j.notify = nil
	j.mu.Unlock()
	if ch != nil {
		close(ch)
	}
}

// Follow calls fn for each event from offset from on (gap > 0 before an event when
// events were dropped), then waits for more, until ctx ends, fn fails or the journal
// closes.
func (j *Journal) Follow(ctx context.Context, from int64, fn func(ev api.NetworkEvent, gap int64) error) error {
	for {
		ch := j.Changed()
		evs, gap := j.Read(from, 256)
		for _, ev := range evs {
			if err := fn(ev, gap); err != nil {
				return err
			}
			gap = 0
			from = ev.Offset + 1
		}
		if len(evs) > 0 {
			continue
		}
		if gap > 0 {
			from += gap
		}
		if j.Closed() {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}
