package node

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

// Health is what a node's GET /healthz answers (docs/operations.md, "Node health"):
// Status "ok" (HTTP 200) when every check passes, else "unhealthy" (HTTP 503) with
// the failing checks' reasons.
type Health struct {
	Status string `json:"status"`
	Node   string `json:"node"`
	ID     string `json:"id"`
	// Epoch is this incarnation's registration epoch (0 before registration).
	Epoch int64 `json:"epoch"`
	// Checks maps each check (registration, database, heartbeat, runtime, disk,
	// shutdown) to "ok" or what is wrong.
	Checks map[string]string `json:"checks"`
	// Reasons lists the failing checks' problems ("check: problem"), empty when healthy.
	Reasons []string `json:"reasons,omitempty"`
	// LastHeartbeat is when the node last recorded a heartbeat (zero: none yet).
	LastHeartbeat time.Time `json:"last_heartbeat,omitzero"`
}

// OK reports whether every check passed.
func (h Health) OK() bool { return h.Status == "ok" }

// healthState is what the node's loops last learnt about its own state.
type healthState struct {
	mu sync.Mutex
	healthFacts
}

// healthFacts are healthState's values.
type healthFacts struct {
	registered bool
	fenced     string    // why the node was fenced ('' while not)
	hbOK       time.Time // last successful heartbeat
	hbErr      string    // last heartbeat error ('' when it succeeded)
	hbFailures int64     // failed heartbeats since start
	runtimeErr string    // why the runtime is unusable ('' while it answers)
	// runtimeFails counts the runtime probes that failed in a row.
	runtimeFails int
	diskLow      string // why the store refuses new disk use
	stopping     bool
}

func (h *healthState) set(fn func(h *healthState)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	fn(h)
}

// runtimeProbeEvery is how many heartbeats pass between two runtime probes (listing
// the runtime's instances: a runsc process with gVisor).
const runtimeProbeEvery = 5

// staleHeartbeats is how many heartbeat periods may pass without a successful
// heartbeat before the node reports itself unhealthy.
const staleHeartbeats = 3

// Health checks the node's state: its registration, PostgreSQL (pinged now, within
// ctx), its heartbeats, its runtime, its store's disk reserve, and shutdown.
func (n *Node) Health(ctx context.Context) Health {
	h := Health{Status: "ok", Node: n.cfg.Name, ID: n.cfg.ID, Checks: map[string]string{}}
	check := func(name, problem string) {
		if problem == "" {
			h.Checks[name] = "ok"
			return
		}
		h.Checks[name] = problem
		h.Reasons = append(h.Reasons, name+": "+problem)
		h.Status = "unhealthy"
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	dbErr := n.st.Ping(pctx)
	cancel()

	n.health.mu.Lock()
	s := n.health.healthFacts
	n.health.mu.Unlock()
	h.Epoch, h.LastHeartbeat = n.currentEpoch(), s.hbOK

	switch {
	case s.fenced != "":
		check("registration", "fenced: "+s.fenced)
	case !s.registered:
		check("registration", "not registered yet (starting)")
	default:
		check("registration", "")
	}
	if dbErr != nil {
		check("database", "cannot reach PostgreSQL: "+dbErr.Error())
	} else {
		check("database", "")
	}
	stale := staleHeartbeats * n.cfg.Heartbeat
	switch {
	case !s.registered:
		check("heartbeat", "none yet")
	case s.hbErr != "" && time.Since(s.hbOK) > stale:
		check("heartbeat", fmt.Sprintf("failing since %s: %s", s.hbOK.UTC().Format(time.RFC3339), s.hbErr))
	case time.Since(s.hbOK) > stale:
		check("heartbeat", fmt.Sprintf("none recorded since %s", s.hbOK.UTC().Format(time.RFC3339)))
	default:
		check("heartbeat", "")
	}
	check("runtime", s.runtimeErr)
	check("disk", s.diskLow)
	if s.stopping {
		check("shutdown", "shutting down")
	} else {
		check("shutdown", "")
	}
	return h
}

func (n *Node) currentEpoch() int64 {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.epoch
}

// probeRuntime records whether the runtime answers (it lists its instances, within
// 10 s); it is unusable after two failed probes in a row.
func (n *Node) probeRuntime(ctx context.Context) {
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := n.rt.List(pctx)
	if ctx.Err() != nil {
		return
	}
	n.health.set(func(h *healthState) {
		if err == nil {
			h.runtimeErr, h.runtimeFails = "", 0
			return
		}
		// One slow answer on a loaded host is not an unusable runtime: two in a row are.
		if h.runtimeFails++; h.runtimeFails >= 2 {
			h.runtimeErr = fmt.Sprintf("unusable (%d probes in a row failed): %v", h.runtimeFails, err)
		}
	})
}

// Fingerprint identifies one installation of a node (store.Node.Fingerprint): the
// host (a hash of /etc/machine-id, else of the host name), the absolute data
// directory, and storeID (the btrfs store's file system id; ” when there is none).
// A restart of the same installation — also right after kill -9 or a reboot —
// presents the same fingerprint; a copy of the data directory to another host or
// another path does not.
func Fingerprint(dataDir, storeID string) string {
	host := "unknown"
	if b, err := os.ReadFile("/etc/machine-id"); err == nil && strings.TrimSpace(string(b)) != "" {
		sum := sha256.Sum256([]byte(strings.TrimSpace(string(b))))
		host = "machine:" + hex.EncodeToString(sum[:6])
	} else if name, err := os.Hostname(); err == nil {
		host = "hostname:" + name
	}
	fp := "host=" + host + " dir=" + dataDir
	if storeID != "" {
		fp += " store=" + storeID
	}
	return fp
}
