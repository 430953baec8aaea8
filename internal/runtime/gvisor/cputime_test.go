package gvisor

import (
	"context"
	"testing"
	"time"
)

// TestCPUTime: the sandbox's host cgroup counts the CPU its code burns, an idle sandbox
// adds next to nothing, a restarted runtime finds the counter again from its records,
// and an instance that is gone has none.
func TestCPUTime(t *testing.T) {
	needRunsc(t)
	ctx := context.Background()
	rt := newTestRuntime(t, testRootDir(t))
	spec := testSpec(t, newID(t))
	c := startSandbox(t, rt, spec)
	read := func(rt *Runtime) time.Duration {
		t.Helper()
		d, err := rt.CPUTime(ctx, spec.ID)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	t0 := read(rt)
	post(t, c, "/spin?ms=500")
	t1 := read(rt)
	if t1-t0 < 100*time.Millisecond {
		t.Fatalf("500 ms of spinning counted %v of CPU", t1-t0)
	}
	// Idle: nothing asked of the agent for a second.
	start := time.Now()
	time.Sleep(time.Second) // the idle period being measured
	idle := read(rt) - t1
	t.Logf("spin 500 ms: %v of CPU; idle %v: %v", t1-t0, time.Since(start).Round(time.Millisecond), idle)
	if idle > 50*time.Millisecond {
		t.Errorf("an idle second used %v of CPU", idle)
	}
	// One question to the agent wakes the sandbox: what the node's samples avoid.
	before := read(rt)
	get(t, c, "/v1/health")
	t.Logf("one agent request: %v of the sandbox's CPU", read(rt)-before)

	fresh := newTestRuntime(t, rt.cfg.RootDir)
	if d := read(fresh); d < t1 {
		t.Fatalf("a restarted runtime reads %v, less than %v before", d, t1)
	}
	if _, err := rt.CPUTime(ctx, newID(t)); err == nil {
		t.Fatal("CPUTime of an unknown instance succeeded")
	}
	if err := rt.Destroy(ctx, spec.ID); err != nil {
		t.Fatal(err)
	}
	if d, err := rt.CPUTime(ctx, spec.ID); err == nil {
		t.Fatalf("CPUTime after Destroy: %v", d)
	}
}
