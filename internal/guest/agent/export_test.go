package agent

import "github.com/spacedev/space/internal/guest/wire"

// StartFollowed starts spec as POST /v1/exec and envd's Start do, and returns its
// output follower, so that a test can hold off its first read for as long as it likes
// (the window between the program's start and a stream's first read that HTTP leaves
// to chance).
func (a *Agent) StartFollowed(spec wire.ProcessSpec) (*Followed, error) {
	p, f, err := a.startProcess(spec, true)
	if err != nil {
		return nil, err
	}
	return &Followed{p: p, f: f}, nil
}

// Followed is a started process and its output follower.
type Followed struct {
	p *process
	f *follower
}

// Bounds returns the first retained offset and the end offset of the output.
func (x *Followed) Bounds() (first, end int64) { return x.p.journal.bounds() }

// WriterHeld tells whether the process's output pump waits for a follower.
func (x *Followed) WriterHeld() bool {
	j := x.p.journal
	j.mu.Lock()
	defer j.mu.Unlock()
	return j.advanced != nil
}

// ReadAt reads output at from as a following stream does; see journal.readAt.
func (x *Followed) ReadAt(from int64, dst []byte) (n int, gap int64) {
	_, n, gap = x.f.readAt(from, dst)
	return n, gap
}

// Close unregisters the follower.
func (x *Followed) Close() { x.f.close() }
