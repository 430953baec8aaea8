package qemu

import (
	"slices"
	"time"
)

// rdtsc reads the CPU's time-stamp counter.
func rdtsc() uint64

// hostTSCkHz measures the host's TSC frequency against the monotonic clock: the median
// of three 20 ms samples (a sample's error is dominated by the two clock reads, well
// under 0.01%).
//
// Under TCG the guest's TSC is the host's. The guest kernel calibrates its TSC against
// the PIT, and on a busy host that calibration fails now and then; with no HPET or PM
// timer on microvm to fall back on, the kernel then marks the TSC unusable and hangs
// early in boot. Passing the frequency (tsc_early_khz=) skips the calibration.
func hostTSCkHz() int64 {
	var samples []int64
	for range 3 {
		t0, c0 := time.Now(), rdtsc()
		time.Sleep(20 * time.Millisecond) // the measurement interval
		c1, t1 := rdtsc(), time.Now()
		if ns := t1.Sub(t0).Nanoseconds(); ns > 0 && c1 > c0 {
			samples = append(samples, int64(float64(c1-c0)*1e6/float64(ns)))
		}
	}
	if len(samples) == 0 {
		return 0
	}
	slices.Sort(samples)
	return samples[len(samples)/2]
}
