package service

import (
	"testing"

	"github.com/spacedev/space/internal/store"
)

// TestFastPathCache checks the exec target cache's rules: nothing is cached or served
// before the listener connects; a notification about the sandbox (or its tokens, or a
// reconnect) drops it; a target read before an invalidation is not remembered after
// it; another tenant never gets it; key revocations cut only that key's streams.
func TestFastPathCache(t *testing.T) {
	f := newFastPath()
	alice := &Principal{Tenant: "a", KeyID: "k1"}
	bob := &Principal{Tenant: "b", KeyID: "k2"}
	target := &Target{Sandbox: &store.Sandbox{ID: "sb1", Tenant: "a"}}

	_, seq := f.lookup(alice, "sb1")
	f.remember(target, seq)
	if got, _ := f.lookup(alice, "sb1"); got != nil {
		t.Fatal("cached before the listener connected")
	}
	f.notify(store.ChannelSandboxes, "") // connected
	_, seq = f.lookup(alice, "sb1")
	f.remember(target, seq)
	if got, _ := f.lookup(alice, "sb1"); got != target {
		t.Fatal("not cached")
	}
	if got, _ := f.lookup(bob, "sb1"); got != nil {
		t.Fatal("served to another tenant")
	}
	for _, ch := range []string{store.ChannelSandboxes, store.ChannelTokens} {
		f.notify(ch, "sb1")
		if got, _ := f.lookup(alice, "sb1"); got != nil {
			t.Fatalf("kept after a %s notification", ch)
		}
		_, seq = f.lookup(alice, "sb1")
		f.remember(target, seq)
	}
	// Read, then a change of any sandbox, then remember: not cached.
	f.forget("sb1")
	_, seq = f.lookup(alice, "sb1")
	f.notify(store.ChannelSandboxes, "sb1")
	f.remember(target, seq)
	if got, _ := f.lookup(alice, "sb1"); got != nil {
		t.Fatal("remembered a target read before an invalidation")
	}
	f.stop()
	_, seq = f.lookup(alice, "sb1")
	f.remember(target, seq)
	if got, _ := f.lookup(alice, "sb1"); got != nil {
		t.Fatal("cached while the listener is gone")
	}

	// Streams: a key's revocation cuts its own; a token revocation its sandbox's.
	cut := map[string]bool{}
	mk := func(name, sandbox, key string) *Execution {
		x := &Execution{sandbox: sandbox, key: key, cancel: func() { cut[name] = true }}
		f.streams[x] = struct{}{}
		return x
	}
	mk("x1", "sb1", "k1")
	mk("x2", "sb2", "k2")
	mk("x3", "sb3", "k3")
	f.notify(store.ChannelKeys, "k2")
	f.notify(store.ChannelTokens, "sb3")
	if cut["x1"] || !cut["x2"] || !cut["x3"] {
		t.Fatalf("cut %v, want x2 and x3", cut)
	}
}
