package store_test

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
	"github.com/spacedev/space/internal/testenv"
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

// TestStatementsWaitForTheDatabase: PostgreSQL cannot be connected to for a while (it
// is restarting: every connection is closed before it starts). Statements of each kind
// begun meanwhile try again and succeed once it is back. One that meets an outage
// longer than the store's Wait fails as fault.Unavailable after about Wait, and one
// whose context ends stops waiting then.
func TestStatementsWaitForTheDatabase(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url := testenv.Postgres(t)
	px := newPGProxy(t, url)
	const wait = time.Second
	st, err := store.Open(ctx, store.Config{URL: px.url, Wait: wait, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.EnsureTenant(ctx, "t1"); err != nil {
		t.Fatal(err)
	}
	kinds := []struct {
		name string
		run  func(context.Context) error
	}{
		{"exec", func(ctx context.Context) error { return st.EnsureTenant(ctx, "t2") }},
		{"query row", func(ctx context.Context) error { _, err := st.GetTenant(ctx, "t1"); return err }},
		{"query", func(ctx context.Context) error {
			ts, err := st.ListTenants(ctx)
			if err == nil && len(ts) == 0 {
				t.Error("no tenants listed")
			}
			return err
		}},
		{"transaction", func(ctx context.Context) error { return st.InTx(ctx, func(*store.Tx) error { return nil }) }},
	}
	for _, k := range kinds {
		t.Run(k.name+" rides out", func(t *testing.T) {
			refusedBefore := px.down()
			done := make(chan error, 1)
			go func() { done <- k.run(ctx) }()
			// Back once the statement has found it down three times.
			deadline := time.Now().Add(10 * time.Second)
			for px.refused() < refusedBefore+3 {
				select {
				case err := <-done:
					t.Fatalf("while PostgreSQL was down: %v", err)
				case <-time.After(5 * time.Millisecond):
				}
				if time.Now().After(deadline) {
					t.Fatalf("the statement tried %d times in 10 s", px.refused()-refusedBefore)
				}
			}
			px.up()
			if err := <-done; err != nil {
				t.Fatalf("once PostgreSQL was back: %v", err)
			}
		})
	}
	t.Run("longer than Wait", func(t *testing.T) {
		px.down()
		defer px.up()
		for _, k := range kinds {
			began := time.Now()
			err := k.run(ctx)
			took := time.Since(began)
			if fault.KindOf(err) != fault.Unavailable {
				t.Errorf("%s: %v (%v), want unavailable", k.name, err, fault.KindOf(err))
			}
			if took < wait || took > wait+2*time.Second {
				t.Errorf("%s failed after %v, want about %v", k.name, took, wait)
			}
		}
		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		began := time.Now()
		if err := kinds[1].run(short); err == nil {
			t.Error("a statement whose context ended succeeded while PostgreSQL was down")
		}
		if took := time.Since(began); took > wait/2 {
			t.Errorf("a statement whose context ended after 100 ms waited %v", took)
		}
	})
}

// pgProxy stands between a store and PostgreSQL on a Unix socket of its own: down
// closes every connection through it and closes each new one at once (as a
// PostgreSQL that is restarting would), up lets them through again.
type pgProxy struct {
	url      string
	target   string // network address of PostgreSQL: "unix" path or "tcp" host:port
	network  string
	mu       sync.Mutex
	isDown   bool
	refusals int
	conns    map[net.Conn]bool
}

func newPGProxy(t *testing.T, url string) *pgProxy {
	t.Helper()
	cfg, err := pgconn.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	p := &pgProxy{network: "tcp", target: net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))), conns: map[net.Conn]bool{}}
	if strings.HasPrefix(cfg.Host, "/") {
		p.network, p.target = "unix", filepath.Join(cfg.Host, ".s.PGSQL."+strconv.Itoa(int(cfg.Port)))
	}
	dir := t.TempDir()
	ln, err := net.Listen("unix", filepath.Join(dir, ".s.PGSQL."+strconv.Itoa(int(cfg.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close(); p.closeAll() })
	go p.serve(ln)
	sep := "?"
	if strings.Contains(url, "?") {
		sep = "&"
	}
	if strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://") {
		p.url = url + sep + "host=" + dir
	} else {
		p.url = url + " host=" + dir
	}
	return p
}

func (p *pgProxy) serve(ln net.Listener) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.isDown {
			p.refusals++
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c] = true
		p.mu.Unlock()
		go p.pipe(c)
	}
}

func (p *pgProxy) pipe(c net.Conn) {
	defer c.Close()
	s, err := net.Dial(p.network, p.target)
	if err != nil {
		return
	}
	defer s.Close()
	p.mu.Lock()
	p.conns[s] = true
	p.mu.Unlock()
	go func() { _, _ = io.Copy(s, c); s.Close() }()
	_, _ = io.Copy(c, s)
}

func (p *pgProxy) closeAll() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.Close()
		delete(p.conns, c)
	}
}

// down closes every connection and refuses new ones; it returns the refusals so far.
func (p *pgProxy) down() int {
	p.mu.Lock()
	p.isDown = true
	n := p.refusals
	p.mu.Unlock()
	p.closeAll()
	return n
}

func (p *pgProxy) up() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.isDown = false
}

func (p *pgProxy) refused() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refusals
}
