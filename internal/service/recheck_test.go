package service

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
)

// After the listener (re)connects, the open exec streams of revoked or deleted keys
// are cut and the others go on (cutting every one made the first command after a
// restart fail with a 500 when the listener connected while it started); when the
// database cannot tell, every stream is cut.
func TestRecheckStreams(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st, err := store.Open(ctx, store.Config{URL: testenv.Postgres(t), Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	live := &store.APIKey{ID: "recheck-live", Name: "live", Prefix: "l", Kind: KeySpace, Tenant: "default"}
	revoked := &store.APIKey{ID: "recheck-revoked", Name: "revoked", Prefix: "r", Kind: KeySpace, Tenant: "default"}
	for i, k := range []*store.APIKey{live, revoked} {
		if err := st.CreateAPIKey(ctx, k, "secret-"+k.ID+string(rune('a'+i))); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := st.RevokeAPIKey(ctx, revoked.ID); err != nil {
		t.Fatal(err)
	}
	s := &Service{st: st, fast: newFastPath(), log: slog.New(slog.DiscardHandler)}
	cut := map[string]bool{}
	for name, key := range map[string]string{"x1": live.ID, "x2": live.ID, "x3": revoked.ID, "x4": "recheck-gone"} {
		s.fast.streams[&Execution{sandbox: "sb", key: key, cancel: func() { cut[name] = true }}] = struct{}{}
	}
	s.fast.notify(store.ChannelKeys, "") // connected
	if len(cut) != 0 {
		t.Fatalf("the reconnect itself cut %v", cut)
	}
	s.recheckStreams(ctx)
	if cut["x1"] || cut["x2"] || !cut["x3"] || !cut["x4"] {
		t.Fatalf("cut %v, want x3 (revoked key) and x4 (deleted key) only", cut)
	}
	st.Close()
	s.recheckStreams(ctx)
	if !cut["x1"] || !cut["x2"] {
		t.Fatalf("with the database gone, cut %v, want every stream", cut)
	}
}
