package agent

import (
	"sync"
	"time"
)

// journal is the bounded output record of one process: stdout and stderr interleaved in
// arrival order, addressed by absolute byte offsets (0 = the first byte the process ever
// wrote). When the bound is reached the oldest bytes are evicted, and readers that were
// still behind them learn it from readAt (gap).
//
// Eviction waits for followers that keep up (see follow): an append that would evict
// bytes a following stream has not taken yet waits until the stream takes them, unless
// that stream has been behind for stall without taking a byte. So a live reader gets
// every byte (the writer slows to its pace once it is a whole journal behind), while a
// reader that stopped reading, or none at all, never holds the writer back for longer
// than stall at a time. Only the pump waits, never a reader.
//
// Hand-rolled rather than built on a library: no ring buffer package offers absolute
// offsets, per-byte stream tags and lazy growth together, and the logic is small.
//
// Bytes live in a ring that grows (by doubling) up to max, so a process that prints a
// line costs a few KiB, not the whole bound. Stream tags are kept as segments (start
// offset + stream); consecutive writes of one stream share a segment. The number of
// segments is bounded too, so a process alternating one-byte writes on both streams
// cannot grow the metadata without bound.
type journal struct {
	mu      sync.Mutex
	max     int
	maxSegs int
	buf     []byte
	first   int64 // offset of the oldest retained byte
	end     int64 // offset one past the newest byte
	segs    []segment
	segHead int // index in segs of the first live segment
	notify  chan struct{}
	onWrite func() // called (without the lock) after each append; may be nil

	stall     time.Duration // see follow; 0: writers never wait (set before the first append)
	followers map[*follower]struct{}
	advanced  chan struct{} // closed when a follower takes bytes or leaves; nil if nobody waits
}

// follower is a following stream's position in the journal: the offset of the next
// byte it takes, and when it last took a byte or was caught up.
type follower struct {
	j    *journal
	pos  int64
	seen time.Time
}

type segment struct {
	off    int64
	stream byte
}

const journalMinBuf = 4096

func newJournal(maxBytes int, onWrite func()) *journal {
	if maxBytes < 1 {
		maxBytes = 1
	}
	return &journal{
		max:       maxBytes,
		maxSegs:   max(1024, maxBytes/64),
		onWrite:   onWrite,
		followers: map[*follower]struct{}{},
	}
}

// append records p as output of stream (wire.FrameStdout or wire.FrameStderr). It
// waits while the bytes it would evict are still owed to a follower that keeps up; a
// piece larger than half the journal goes in halves, so that a follower can take each
// before the next one pushes it out.
func (j *journal) append(stream byte, p []byte) {
	if len(p) == 0 {
		return
	}
	for len(p) > 0 {
		n := len(p)
		if j.stall > 0 {
			n = min(n, max(j.max/2, 1))
		}
		j.appendPiece(stream, p[:n])
		p = p[n:]
	}
	if j.onWrite != nil {
		j.onWrite()
	}
}

func (j *journal) appendPiece(stream byte, p []byte) {
	j.mu.Lock()
	for {
		wait, until := j.heldBack(len(p), time.Now())
		if wait == nil {
			break
		}
		j.mu.Unlock()
		t := time.NewTimer(until)
		select {
		case <-wait:
		case <-t.C:
		}
		t.Stop()
		j.mu.Lock()
	}
	now := time.Now()
	for f := range j.followers {
		if f.pos >= j.end {
			f.seen = now // caught up until this append: it starts being behind now
		}
	}
	j.appendLocked(stream, p)
	ch := j.notify
	j.notify = nil
	j.mu.Unlock()
	if ch != nil {
		close(ch)
	}
}

func (j *journal) appendLocked(stream byte, p []byte) {
	need := int(j.end-j.first) + len(p)
	if need > len(j.buf) && len(j.buf) < j.max {
		j.grow(need)
	}
	j.addSegment(stream)
	if len(p) > len(j.buf) {
		// Only the tail fits: everything before it, old or new, is dropped.
		skip := len(p) - len(j.buf)
		j.end += int64(skip)
		j.first = j.end
		p = p[skip:]
	}
	if over := int(j.end-j.first) + len(p) - len(j.buf); over > 0 {
		j.first += int64(over)
	}
	// Copy p into the ring at j.end, wrapping as needed.
	for len(p) > 0 {
		pos := int(j.end % int64(len(j.buf)))
		n := copy(j.buf[pos:], p)
		p = p[n:]
		j.end += int64(n)
	}
	j.trimSegments()
}

// grow enlarges the ring to hold at least need bytes (capped at max), keeping every
// retained byte at its offset.
func (j *journal) grow(need int) {
	n := max(len(j.buf)*2, journalMinBuf)
	for n < need {
		n *= 2
	}
	n = min(n, j.max)
	nb := make([]byte, n)
	for o := j.first; o < j.end; {
		op := int(o % int64(len(j.buf)))
		np := int(o % int64(n))
		k := min(int(j.end-o), len(j.buf)-op, n-np)
		copy(nb[np:np+k], j.buf[op:op+k])
		o += int64(k)
	}
	j.buf = nb
}

func (j *journal) addSegment(stream byte) {
	if j.segHead < len(j.segs) && j.segs[len(j.segs)-1].stream == stream {
		return
	}
	if live := len(j.segs) - j.segHead; live >= j.maxSegs {
		// Too many segments: drop the oldest one with its bytes.
		j.segHead++
		if j.first < j.segs[j.segHead].off {
			j.first = j.segs[j.segHead].off
		}
	}
	j.segs = append(j.segs, segment{off: j.end, stream: stream})
}

// trimSegments forgets segments that end at or before first and compacts the slice.
func (j *journal) trimSegments() {
	for j.segHead+1 < len(j.segs) && j.segs[j.segHead+1].off <= j.first {
		j.segHead++
	}
	if j.segHead > 64 && j.segHead*2 > len(j.segs) {
		n := copy(j.segs, j.segs[j.segHead:])
		j.segs = j.segs[:n]
		j.segHead = 0
	}
}

// heldBack tells whether an append of n bytes must wait: it returns a channel closed
// when a follower advances or leaves, and how long until the first follower that holds
// it back counts as stalled; nil if nothing holds it back.
func (j *journal) heldBack(n int, now time.Time) (<-chan struct{}, time.Duration) {
	if j.stall <= 0 || len(j.followers) == 0 {
		return nil, 0
	}
	evict := j.end + int64(n) - int64(j.max) // the first offset retained after the append
	if evict <= j.first {
		return nil, 0
	}
	var until time.Duration
	for f := range j.followers {
		if f.pos >= evict {
			continue
		}
		left := j.stall - now.Sub(f.seen)
		if left <= 0 {
			continue // stalled: it will get a gap
		}
		if until == 0 || left < until {
			until = left
		}
	}
	if until == 0 {
		return nil, 0
	}
	if j.advanced == nil {
		j.advanced = make(chan struct{})
	}
	return j.advanced, until
}

// follow registers a following stream that starts reading at offset from. Its reads
// (follower.readAt) hold back evictions of bytes it has not taken while it keeps up;
// close it when the stream ends.
func (j *journal) follow(from int64) *follower {
	j.mu.Lock()
	defer j.mu.Unlock()
	f := &follower{j: j, pos: from, seen: time.Now()}
	j.followers[f] = struct{}{}
	return f
}

// readAt is journal.readAt for this follower: what it returns counts as taken.
func (f *follower) readAt(from int64, dst []byte) (stream byte, n int, gap int64) {
	j := f.j
	j.mu.Lock()
	defer j.mu.Unlock()
	stream, n, gap = j.readAtLocked(from, dst)
	if next := from + int64(n) + gap; next > f.pos || next >= j.end {
		f.pos = next
		f.seen = time.Now()
		j.advancedLocked()
	}
	return stream, n, gap
}

// close unregisters the follower; a writer it held back goes on.
func (f *follower) close() {
	j := f.j
	j.mu.Lock()
	defer j.mu.Unlock()
	delete(j.followers, f)
	j.advancedLocked()
}

func (j *journal) advancedLocked() {
	if j.advanced != nil {
		close(j.advanced)
		j.advanced = nil
	}
}

// bounds returns the first retained offset and the end offset.
func (j *journal) bounds() (first, end int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.first, j.end
}

// readAt copies bytes starting at from into dst, stopping at a stream boundary. It
// returns the stream of the copied bytes and their count. When from is older than the
// first retained byte it copies nothing and returns gap > 0, the number of bytes
// dropped between from and first (the caller continues at from+gap).
func (j *journal) readAt(from int64, dst []byte) (stream byte, n int, gap int64) {
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.readAtLocked(from, dst)
}

func (j *journal) readAtLocked(from int64, dst []byte) (stream byte, n int, gap int64) {
	if from < j.first {
		return 0, 0, j.first - from
	}
	if from >= j.end || len(dst) == 0 {
		return 0, 0, 0
	}
	// Find the segment holding from: the last segment starting at or before it.
	lo, hi := j.segHead, len(j.segs)-1
	for lo < hi {
		mid := (lo + hi + 1) / 2
		if j.segs[mid].off <= from {
			lo = mid
		} else {
			hi = mid - 1
		}
	}
	limit := j.end
	if lo+1 < len(j.segs) {
		limit = j.segs[lo+1].off
	}
	want := min(int64(len(dst)), limit-from)
	for int64(n) < want {
		pos := int((from + int64(n)) % int64(len(j.buf)))
		k := copy(dst[n:want], j.buf[pos:])
		n += k
	}
	return j.segs[lo].stream, n, 0
}

// changed returns a channel closed at the next append or wake. Take it before checking
// the state it guards, so that no change is missed.
func (j *journal) changed() <-chan struct{} {
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.notify == nil {
		j.notify = make(chan struct{})
	}
	return j.notify
}

// wake notifies readers of a change that is not an append (process state).
func (j *journal) wake() {
	j.mu.Lock()
	ch := j.notify
	j.notify = nil
	j.mu.Unlock()
	if ch != nil {
		close(ch)
	}
}
