package gvisor

import (
	"os"
	"slices"
	"testing"
)

func TestChanges(t *testing.T) {
	for _, c := range []struct {
		args []string
		want bool
		ids  []string
	}{
		{[]string{"--version"}, false, nil},
		{[]string{"--root=/r", "--platform=systrap", "state", "abc"}, false, nil},
		{[]string{"--root=/r", "list", "-format=json"}, false, nil},
		{[]string{"--root=/r", "pause", "abc"}, true, []string{"abc"}},
		{[]string{"--root=/r", "--platform=systrap", "checkpoint", "-image-path", "/d", "abc"}, true, []string{"abc"}},
		{[]string{"--root=/r", "delete", "-force", "abc"}, true, []string{"abc"}},
		{[]string{"--root=/r", "kill", "abc", "KILL"}, true, []string{"abc"}},
	} {
		got, ids := changes(c.args)
		if got != c.want || !slices.Equal(ids, c.ids) {
			t.Errorf("changes(%q) = %v %q, want %v %q", c.args, got, ids, c.want, c.ids)
		}
	}
}

// TestStatusCache: a state is kept only for a live sandbox process and only when no
// change of its instance began or ended since it was asked; a hit needs the same
// process alive; a change of another instance leaves it.
func TestStatusCache(t *testing.T) {
	var c statusCache
	me := containerState{ID: "a", Status: "paused", PID: os.Getpid()}
	_, ok, gen := c.get("a")
	if ok {
		t.Fatal("hit in an empty cache")
	}
	c.put("a", me, gen)
	if st, ok, _ := c.get("a"); !ok || st.Status != "paused" {
		t.Fatalf("get after put = %+v, %v", st, ok)
	}
	// A change of another instance keeps it.
	c.change([]string{"b"})()
	if _, ok, _ := c.get("a"); !ok {
		t.Fatal("a change of b dropped a")
	}
	// A change of a drops it, and a read that overlapped the change is not kept.
	_, _, gen = c.get("a")
	done := c.change([]string{"a"})
	if _, ok, _ := c.get("a"); ok {
		t.Fatal("kept across its change")
	}
	c.put("a", me, gen)
	done()
	if _, ok, _ := c.get("a"); ok {
		t.Fatal("a state read across a change was kept")
	}
	// A change that names no instance drops everything.
	_, _, gen = c.get("a")
	c.put("a", me, gen)
	c.change(nil)()
	if _, ok, _ := c.get("a"); ok {
		t.Fatal("kept across a change of all")
	}
	// Stopped states and dead processes are never kept.
	_, _, gen = c.get("a")
	c.put("a", containerState{ID: "a", Status: "stopped", PID: os.Getpid()}, gen)
	c.put("b", containerState{ID: "b", Status: "running", PID: 1 << 30}, gen)
	if _, ok, _ := c.get("a"); ok {
		t.Fatal("a stopped state was kept")
	}
	if _, ok, _ := c.get("b"); ok {
		t.Fatal("a state without a live process was kept")
	}
	// A process whose start time differs (its pid was reused) is a miss.
	c.put("a", me, gen)
	c.mu.Lock()
	e := c.m["a"]
	e.start++
	c.m["a"] = e
	c.mu.Unlock()
	if _, ok, _ := c.get("a"); ok {
		t.Fatal("a reused pid was a hit")
	}
}

func TestStatusCacheGone(t *testing.T) {
	var c statusCache
	if c.isGone("a") {
		t.Fatal("gone in an empty cache")
	}
	c.gone("a")
	if !c.isGone("a") || c.isGone("b") {
		t.Fatalf("after gone(a): a %v, b %v", c.isGone("a"), c.isGone("b"))
	}
	c.change([]string{"b"})()
	if !c.isGone("a") {
		t.Fatal("a change of b forgot that a is gone")
	}
	// Any change of a (a record claimed, a runsc command naming it) ends it.
	c.change([]string{"a"})()
	if c.isGone("a") {
		t.Fatal("still gone after a change of a")
	}
	c.gone("a")
	c.change(nil)()
	if c.isGone("a") {
		t.Fatal("still gone after a change of every instance")
	}
}

func TestStatusCacheStopped(t *testing.T) {
	var c statusCache
	c.stopped("a")
	if !c.isStopped("a") || c.isStopped("b") {
		t.Fatalf("after stopped(a): a %v, b %v", c.isStopped("a"), c.isStopped("b"))
	}
	c.change([]string{"b"})()
	if !c.isStopped("a") {
		t.Fatal("a change of b forgot that a stopped")
	}
	// Any runsc command naming a (the destroy's delete, a restore) ends it.
	c.change([]string{"a"})()
	if c.isStopped("a") {
		t.Fatal("still stopped after a change of a")
	}
	c.stopped("a")
	c.change(nil)()
	if c.isStopped("a") {
		t.Fatal("still stopped after a change of every instance")
	}
	c.stopped("a")
	c.gone("a")
	if c.isStopped("a") {
		t.Fatal("still stopped once destroyed")
	}
}

func TestStatusCacheAbsent(t *testing.T) {
	var c statusCache
	_, _, gen := c.get("a")
	c.absent("a", gen)
	if !c.isGone("a") {
		t.Fatal("an id seen absent is not known gone")
	}
	// A look that began before a change of the id (a Create claiming its record) does
	// not mark it.
	c.change([]string{"a"})()
	_, _, gen = c.get("a")
	c.change([]string{"a"})() // the create began after the look
	c.absent("a", gen)
	if c.isGone("a") {
		t.Fatal("a stale look marked a changed id gone")
	}
}
