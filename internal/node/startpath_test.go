package node

import (
	"testing"
	"time"
)

// TestStartTimesChoosesByMeasurement: base snapshots are used until both paths have
// enough samples; then only while the median restore is no slower than the median
// boot, with a probe restore every startProbeEvery creates; each key on its own.
func TestStartTimesChoosesByMeasurement(t *testing.T) {
	var s startTimes
	const k = "rel-1cpu-512mb"
	ms := func(n int) time.Duration { return time.Duration(n) * time.Millisecond }
	for i := 0; i < startMinSamples; i++ {
		if ok, _ := s.useSnapshot(k); !ok {
			t.Fatalf("boots preferred after %d samples", i)
		}
		s.record(k, "boot", ms(300))
		if i < startMinSamples-1 {
			s.record(k, "snapshot", ms(500))
		}
	}
	if ok, _ := s.useSnapshot(k); !ok {
		t.Fatal("boots preferred with too few restores measured")
	}
	s.record(k, "snapshot", ms(500))
	var restores int
	for i := 0; i < 2*startProbeEvery; i++ {
		ok, why := s.useSnapshot(k)
		if ok {
			restores++
		} else if why == "" {
			t.Fatal("no reason given for booting")
		}
	}
	if restores != 2 {
		t.Fatalf("%d probe restores in %d creates, want 2", restores, 2*startProbeEvery)
	}
	if ok, _ := s.useSnapshot("other"); !ok {
		t.Fatal("another key is affected")
	}
	// Restores become faster: the window moves and snapshots win again.
	for i := 0; i < startWindow; i++ {
		s.record(k, "snapshot", ms(100))
	}
	for i := 0; i < startProbeEvery; i++ {
		if ok, _ := s.useSnapshot(k); !ok {
			t.Fatal("boots still preferred after restores got faster")
		}
	}
}
