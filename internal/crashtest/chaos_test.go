package crashtest_test

import (
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/spacedev/space/api"
)

// TestChaos mixes lifecycle verbs with kills of space serve, of its PostgreSQL and of
// sandbox instances, for a bounded time, then checks the invariants of every sandbox.
// The run is reproducible from its seed: SPACE_CHAOS_SEED=<seed> (logged) replays
// the same choices; SPACE_CHAOS_DURATION sets how long it runs (default 40s).
func TestChaos(t *testing.T) {
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("SPACE_CHAOS_SEED"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("SPACE_CHAOS_SEED: %v", err)
		}
		seed = n
	}
	dur := 40 * time.Second
	if v := os.Getenv("SPACE_CHAOS_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("SPACE_CHAOS_DURATION: %v", err)
		}
		dur = d
	}
	t.Logf("chaos seed %d (SPACE_CHAOS_SEED=%d reproduces the choices), %s", seed, seed, dur)
	rng := rand.New(rand.NewPCG(seed, seed^0x5ace))

	s := newServer(t, true)
	s.start()
	worlds := map[string]*world{}
	var order []string
	for range 3 {
		id, pid := create(t, s, true)
		worlds[id] = &world{ids: []string{id}, pid: pid}
		order = append(order, id)
	}
	verbs := []string{api.OpPause, api.OpResume, api.OpSuspend, api.OpWake, api.OpStop, api.OpStart}
	counts := map[string]int{}
	deadline := time.Now().Add(dur)
	for time.Now().Before(deadline) {
		if s.exited() {
			s.start()
		}
		id := order[rng.IntN(len(order))]
		w := worlds[id]
		switch r := rng.IntN(100); {
		case r < 60:
			v := verbs[rng.IntN(len(verbs))]
			if op, err := s.C.Lifecycle(ctx(t, 10*time.Second), id, v); err == nil {
				w.ops = append(w.ops, op.ID)
				counts[v]++
			}
		case r < 68:
			if clones, err := s.C.Clone(ctx(t, 10*time.Second), id, api.CloneRequest{Count: 1}); err == nil {
				c := clones[0]
				worlds[c.ID] = &world{ids: []string{c.ID}, ops: []string{c.Operation.ID}}
				order = append(order, c.ID)
				counts["clone"]++
			}
		case r < 80:
			s.kill() // kill -9 of space serve
			counts["kill space"]++
			s.start()
		case r < 88:
			if b, err := os.ReadFile(filepath.Join(s.dataDir, "postgres", "data", "postmaster.pid")); err == nil {
				if pid, err := strconv.Atoi(firstLine(b)); err == nil && pid > 1 {
					_ = syscall.Kill(pid, syscall.SIGKILL) // kill -9 of PostgreSQL
					counts["kill postgres"]++
				}
			}
		default:
			if b, err := os.ReadFile(filepath.Join(s.dataDir, "fake", "instances", id+".json")); err == nil {
				var pid int
				if _, err := scanPID(b, &pid); err == nil && pid > 1 {
					killTree(pid) // the runtime's instance dies
					counts["kill instance"]++
				}
			}
		}
		time.Sleep(time.Duration(50+rng.IntN(400)) * time.Millisecond)
	}
	t.Logf("chaos actions: %v", counts)
	if s.exited() {
		s.start()
	}
	for _, id := range order {
		w := worlds[id]
		w.keep = false // memory may be lost by design (instances were killed)
		if !checkWorld(t, s, w, "chaos("+id+")") {
			t.Fatalf("seed %d: invariants broken", seed)
		}
	}
}

func firstLine(b []byte) string {
	for i, c := range b {
		if c == '\n' {
			return string(b[:i])
		}
	}
	return string(b)
}
