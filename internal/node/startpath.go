package node

import (
	"slices"
	"sync"
	"time"
)

// The base snapshot path is chosen by measurement: a restore is not always faster than a
// boot (under gVisor a boot of a plain template costs about as much as a restore, and a
// restored Sentry keeps its restore's heap: ~7 MiB more host memory per idle sandbox,
// docs/benchmarks.md). The node keeps the time of its recent starts per template
// release and size class, and once both paths have been measured often enough, `auto`
// (a create that neither asks for a fresh boot nor names a snapshot) restores only while
// the median restore is no slower than the median boot. While boots are preferred, every
// startProbeEvery-th create still restores, so that the comparison follows the host.
const (
	// startMinSamples is how many starts of each path it takes before boots can be
	// preferred (until then base snapshots are used, as before they were measured).
	startMinSamples = 5
	// startWindow is how many recent starts of each path are kept.
	startWindow = 16
	// startProbeEvery: while boots are preferred, one create in this many restores.
	startProbeEvery = 4
)

// startTimes is the node's record of recent start durations, by base snapshot key.
type startTimes struct {
	mu sync.Mutex
	by map[string]*startRecord
}

type startRecord struct {
	boot, snap []time.Duration
	skipped    int // creates that booted since the last probe restore
}

func (s *startTimes) rec(key string) *startRecord {
	if s.by == nil {
		s.by = map[string]*startRecord{}
	}
	r := s.by[key]
	if r == nil {
		r = &startRecord{}
		s.by[key] = r
	}
	return r
}

// record adds one start's duration ("boot" or "snapshot").
func (s *startTimes) record(key, path string, d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rec(key)
	add := func(xs []time.Duration) []time.Duration {
		xs = append(xs, d)
		if len(xs) > startWindow {
			xs = xs[len(xs)-startWindow:]
		}
		return xs
	}
	switch path {
	case "boot":
		r.boot = add(r.boot)
	case "snapshot":
		r.snap = add(r.snap)
	}
}

// useSnapshot says whether an `auto` create should restore the base snapshot of key,
// and why not when it should not.
func (s *startTimes) useSnapshot(key string) (bool, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.rec(key)
	if len(r.boot) < startMinSamples || len(r.snap) < startMinSamples {
		return true, ""
	}
	b, sn := medianDur(r.boot), medianDur(r.snap)
	if sn <= b {
		r.skipped = 0
		return true, ""
	}
	r.skipped++
	if r.skipped >= startProbeEvery {
		r.skipped = 0
		return true, "" // the probe: keep measuring restores
	}
	return false, "median restore " + sn.Round(time.Millisecond).String() + " > median boot " + b.Round(time.Millisecond).String()
}

func medianDur(xs []time.Duration) time.Duration {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}
