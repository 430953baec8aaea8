package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/store"
)

// listeners are the addresses space serve binds, all before any role starts.
type listeners struct {
	main    net.Listener // --listen
	e2b     net.Listener // --e2b-listen (api role; nil: off)
	metrics net.Listener // --metrics-listen (nil: off)
}

// bindListeners binds every listener serve needs; the first that cannot bind fails
// serve with an error naming its flag and address (nothing is left bound).
//
// Socket activation: systemd (or anything that speaks its protocol: LISTEN_PID,
// LISTEN_FDS, LISTEN_FDNAMES) may pass the listening sockets instead, each named after
// its flag (FileDescriptorName=listen, e2b-listen or metrics-listen in the .socket
// unit; a single unnamed socket is --listen's). A passed socket is used in place of
// binding its flag's address. It outlives the process, so connections made while
// space serve restarts wait in its queue for the next process instead of being refused
// (docs/operations.md, "Running under systemd").
func (c *serveConfig) bindListeners() (_ *listeners, err error) {
	l := &listeners{}
	passed, err := activation.ListenersWithNames()
	if err != nil {
		return nil, fmt.Errorf("sockets passed by systemd: %w", err)
	}
	if len(passed) == 1 {
		for name, lns := range passed {
			if strings.HasPrefix(name, "LISTEN_FD_") && len(lns) == 1 { // unnamed
				passed = map[string][]net.Listener{"listen": lns}
			}
		}
	}
	defer func() {
		if err != nil {
			l.close()
			for _, lns := range passed {
				for _, ln := range lns {
					_ = ln.Close()
				}
			}
		}
	}()
	bind := func(flag, addr, hint string) (net.Listener, error) {
		name := strings.TrimPrefix(flag, "--")
		if lns := passed[name]; len(lns) > 0 {
			if len(lns) > 1 {
				return nil, fmt.Errorf("%s: systemd passed %d sockets named %q; pass one", flag, len(lns), name)
			}
			delete(passed, name)
			return lns[0], nil
		}
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			if errors.Is(err, unix.EADDRINUSE) {
				return nil, fmt.Errorf("%s %s: the address is taken (is another space serve running?): pick a free one%s: %w", flag, addr, hint, err)
			}
			return nil, fmt.Errorf("%s %s: cannot listen%s: %w", flag, addr, hint, err)
		}
		return ln, nil
	}
	if l.main, err = bind("--listen", c.listen, ""); err != nil {
		return nil, err
	}
	if c.has("api") && c.e2bListen != "" {
		if l.e2b, err = bind("--e2b-listen", c.e2bListen, `, or turn the E2B-compatible API off with --e2b-listen ""`); err != nil {
			return nil, err
		}
	}
	if c.metricsListen != "" {
		if l.metrics, err = bind("--metrics-listen", c.metricsListen, ""); err != nil {
			return nil, err
		}
	}
	if len(passed) > 0 {
		names := slices.Sorted(maps.Keys(passed))
		return nil, fmt.Errorf("systemd passed sockets space serve has no use for: %s (name them after the flag they stand for: FileDescriptorName=listen, e2b-listen or metrics-listen; e2b-listen needs the api role and a non-empty --e2b-listen, metrics-listen a non-empty --metrics-listen)", strings.Join(names, ", "))
	}
	return l, nil
}

func (l *listeners) close() {
	for _, ln := range []net.Listener{l.main, l.e2b, l.metrics} {
		if ln != nil {
			_ = ln.Close()
		}
	}
}

// nodeHealthz serves a node's GET /healthz: its node.Health as JSON, 200 when healthy,
// 503 otherwise (docs/operations.md, "Node health").
func nodeHealthz(n *node.Node) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 3*time.Second)
		defer cancel()
		h := n.Health(ctx)
		code := http.StatusOK
		if !h.OK() {
			code = http.StatusServiceUnavailable
		}
		rest.WriteJSON(w, code, h)
	})
}

// operatorOnly serves h to requests that bear an operator's API key (a node-only
// process's /metrics on --listen, as the api's).
func operatorOnly(st *store.Store, log *slog.Logger, h http.Handler) http.Handler {
	return rest.Handle(log, func(w http.ResponseWriter, r *http.Request) error {
		secret := strings.TrimSpace(rest.Bearer(r))
		if secret == "" || strings.HasPrefix(secret, "spt1.") || len(secret) > 512 {
			return fault.New(fault.Unauthorized, "GET /metrics needs an operator API key (or serve them without one on --metrics-listen)")
		}
		k, err := st.LookupAPIKey(r.Context(), secret)
		if fault.Is(err, fault.NotFound) || err == nil && (k.Role != store.RoleOperator || k.Kind != "space") {
			return fault.New(fault.Unauthorized, "GET /metrics needs an operator API key")
		}
		if err != nil {
			return err
		}
		h.ServeHTTP(w, r)
		return nil
	})
}

// storeFingerprintID is the btrfs store's file system id (statfs f_fsid: derived
// from the file system's UUID), ” when it cannot be read.
func storeFingerprintID(root string) string {
	var st unix.Statfs_t
	if root == "" || unix.Statfs(root, &st) != nil {
		return ""
	}
	return fmt.Sprintf("%08x%08x", uint32(st.Fsid.Val[0]), uint32(st.Fsid.Val[1]))
}
