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

// TestKeyCache checks the API key cache's rules: nothing cached before the listener
// connects; a key's revocation (notified, or done by this process) drops it and only
// it; a key read before a revocation notification is not remembered after it; a key
// of another kind is not served; a reconnect or a tenant's deletion drops every key.
func TestKeyCache(t *testing.T) {
	f := newFastPath()
	k1 := Principal{KeyID: "k1", Tenant: "a"}
	k2 := Principal{KeyID: "k2", Tenant: "b"}
	_, seq := f.key("h1", KeySpace)
	f.rememberKey("h1", KeySpace, k1, seq)
	if p, _ := f.key("h1", KeySpace); p != nil {
		t.Fatal("cached before the listener connected")
	}
	f.notify(store.ChannelKeys, "") // connected
	remember := func(h string, p Principal) {
		_, seq := f.key(h, KeySpace)
		f.rememberKey(h, KeySpace, p, seq)
	}
	remember("h1", k1)
	remember("h2", k2)
	if p, _ := f.key("h1", KeySpace); p == nil || *p != k1 {
		t.Fatalf("not cached: %v", p)
	}
	if p, _ := f.key("h1", KeyE2B); p != nil {
		t.Fatal("served for another kind")
	}
	f.notify(store.ChannelKeys, "k1")
	if p, _ := f.key("h1", KeySpace); p != nil {
		t.Fatal("kept after its revocation")
	}
	if p, _ := f.key("h2", KeySpace); p == nil {
		t.Fatal("another key's revocation dropped it")
	}
	f.dropKeys("k2")
	if p, _ := f.key("h2", KeySpace); p != nil {
		t.Fatal("kept after this process revoked it")
	}
	_, seq = f.key("h1", KeySpace)
	f.notify(store.ChannelKeys, "k9")
	f.rememberKey("h1", KeySpace, k1, seq)
	if p, _ := f.key("h1", KeySpace); p != nil {
		t.Fatal("remembered a key read before a revocation")
	}
	remember("h1", k1)
	f.dropKeys("") // a tenant deleted
	if p, _ := f.key("h1", KeySpace); p != nil {
		t.Fatal("kept after every key was dropped")
	}
	remember("h1", k1)
	f.stop()
	if p, _ := f.key("h1", KeySpace); p != nil {
		t.Fatal("served while the listener is gone")
	}
}
