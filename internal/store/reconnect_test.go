package store_test

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/spacedev/space/internal/store"
)

// TestStatementsRunAgainOnDroppedConnections: PostgreSQL drops every session (as a
// restart or a failover does) right after they were used; the next statement of each
// kind — Exec, QueryRow, Query (also one the connection had prepared), a transaction —
// meets a dropped connection, and runs again on a fresh one instead of failing.
func TestStatementsRunAgainOnDroppedConnections(t *testing.T) {
	st, ctx, url := openURL(t)
	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if err := st.EnsureTenant(ctx, "t1"); err != nil {
		t.Fatal(err)
	}
	// dropAll fills the pool with connections used just now, then ends their sessions.
	dropAll := func(t *testing.T) {
		t.Helper()
		const conns = 4
		var inTx sync.WaitGroup
		inTx.Add(conns)
		errs := make(chan error, conns)
		for range conns {
			go func() {
				errs <- st.InTx(ctx, func(*store.Tx) error {
					inTx.Done()
					inTx.Wait() // all four at once: four connections
					return nil
				})
			}()
		}
		for range conns {
			if err := <-errs; err != nil {
				t.Fatal(err)
			}
		}
		const others = `FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'`
		rows, err := admin.Query(ctx, `SELECT pid, pg_terminate_backend(pid) `+others)
		if err != nil {
			t.Fatal(err)
		}
		var pids []int
		for rows.Next() {
			var pid int
			var ok bool
			if err := rows.Scan(&pid, &ok); err != nil {
				t.Fatal(err)
			}
			pids = append(pids, pid)
		}
		if rows.Err() != nil || len(pids) < conns {
			t.Fatalf("ended %d sessions, want %d: %v", len(pids), conns, rows.Err())
		}
		// Gone once their processes are: a process's sockets close when it exits.
		deadline := time.Now().Add(10 * time.Second)
		for _, pid := range pids {
			for {
				if _, err := os.Stat("/proc/" + strconv.Itoa(pid)); errors.Is(err, fs.ErrNotExist) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("session process %d still there", pid)
				}
				time.Sleep(2 * time.Millisecond)
			}
		}
	}
	for _, c := range []struct {
		name string
		run  func() error
	}{
		{"exec", func() error { return st.EnsureTenant(ctx, "t2") }},
		{"query row", func() error { _, err := st.GetTenant(ctx, "t1"); return err }},
		{"query", func() error {
			ts, err := st.ListTenants(ctx)
			if err == nil && len(ts) == 0 {
				t.Error("no tenants listed")
			}
			return err
		}},
		{"transaction", func() error { return st.InTx(ctx, func(*store.Tx) error { return nil }) }},
	} {
		t.Run(c.name, func(t *testing.T) {
			// Run it first, so that the connections have its statement prepared.
			for range 3 {
				if err := c.run(); err != nil {
					t.Fatal(err)
				}
			}
			dropAll(t)
			if err := c.run(); err != nil {
				t.Fatalf("after PostgreSQL dropped the sessions: %v", err)
			}
		})
	}
}
