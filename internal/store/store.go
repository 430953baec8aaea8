// Package store owns space's PostgreSQL schema and every query against it: API keys,
// signing keys, nodes, template releases and tags, sandboxes (desired and observed
// state), operations and their logs, idempotency records, and the LISTEN/NOTIFY
// channels that wake the controller and the nodes. Migrations are embedded SQL applied
// by goose at start-up under an advisory lock, so several replicas may start at once.
package store

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/spacedev/space/internal/fault"
)

//go:embed migrations/*.sql
var migrations embed.FS

// Store is a handle on the database.
type Store struct {
	pool db
	url  string
	log  *slog.Logger
}

// db is the connection pool, with connection failures turned into fault.Unavailable:
// while PostgreSQL is down (restarting, failing over) requests fail with a 503 that
// clients retry, not with a 500. Short outages are ridden out: a statement that cannot
// connect (PostgreSQL refuses, is not there, or is still starting) tries again with a
// growing pause, for up to wait since it was first tried, before it fails. A statement
// that meets a connection PostgreSQL dropped before the statement reached it (lost)
// runs again at once on a fresh connection, and so does a read or a BEGIN whose
// connection failed after it was sent (dropped): after PostgreSQL is back, nobody sees
// the stale connections of before. A write whose connection failed after it was sent
// may have happened, and is never run again.
type db struct {
	p    *pgxpool.Pool
	wait time.Duration
}

// DefaultWait is how long a statement waits for PostgreSQL to come back by default: an
// embedded PostgreSQL killed is back in about a second (half a second before the
// supervisor starts it again, a few hundred milliseconds of recovery).
const DefaultWait = 5 * time.Second

// Bounds of the pause between two tries while PostgreSQL is down.
const (
	firstPause = 20 * time.Millisecond
	maxPause   = 250 * time.Millisecond
)

// try is one statement's tries, from its first.
type try struct {
	d     db
	ctx   context.Context
	start time.Time
	n     int
	read  bool // the statement only reads: it may run again whatever became of it
}

func (d db) try(ctx context.Context) *try { return &try{d: d, ctx: ctx, start: time.Now()} }

// reading is a try of statement sql, which only reads if it is a SELECT.
func (d db) reading(ctx context.Context, sql string) *try {
	t := d.try(ctx)
	sql = strings.TrimSpace(sql)
	t.read = len(sql) >= 6 && strings.EqualFold(sql[:6], "select")
	return t
}

// again reports whether the statement runs again after it failed with err: at once
// if its connection was lost (the first time), after a pause while PostgreSQL is down
// (and after a second loss), as long as d.wait has not passed since the first try and
// ctx has not ended. A statement that only reads is lost with its connection whenever
// the connection fails (dropped), even after it was sent.
func (t *try) again(err error) bool {
	if t.read {
		return t.after(err, t.d.dropped)
	}
	return t.after(err, t.d.lost)
}

// after is again, with lost deciding which failures came before the statement reached
// PostgreSQL (and drops the pool's stale connections).
func (t *try) after(err error, lost func(context.Context, error) bool) bool {
	if err == nil || t.ctx.Err() != nil {
		return false
	}
	isDown := down(err)
	if !isDown && !lost(t.ctx, err) {
		return false
	}
	t.n++
	if !isDown && t.n == 1 {
		return true
	}
	left := t.d.wait - time.Since(t.start)
	if left <= 0 {
		return false
	}
	pause := time.NewTimer(min(firstPause<<min(t.n-1, 8), maxPause, left))
	defer pause.Stop()
	select {
	case <-t.ctx.Done():
		return false
	case <-pause.C:
		return true
	}
}

// down reports whether err is a failure to connect that says PostgreSQL is not there
// or not ready (refused, no socket, starting up, shutting down): nothing of the
// statement was sent. A refusal (a wrong password, a database that does not exist) is
// not down.
func down(err error) bool {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return strings.HasPrefix(pe.Code, "57P") || strings.HasPrefix(pe.Code, "08")
	}
	return true
}

// lost reports whether err is a pooled connection found dropped before anything of the
// statement was sent (pgconn.SafeToRetry: PostgreSQL restarted, failed over, or ended
// the session), so that running the statement again is safe. Every connection made
// before is as stale, so the pool drops them all. The pool pings only connections idle
// for over a second when it hands them out; these were in use just before the drop.
func (d db) lost(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() != nil || !pgconn.SafeToRetry(err) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		strings.Contains(err.Error(), "conn busy") {
		return false
	}
	d.p.Reset()
	return true
}

func (d db) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t := d.try(ctx)
	for {
		tag, err := d.p.Exec(ctx, sql, args...)
		if !t.again(err) {
			return tag, unavailable(err)
		}
	}
}

func (d db) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	q := query{d.reading(ctx, sql), sql, args}
	rows, err := q.run()
	if err != nil {
		return rows, unavailable(err)
	}
	return &classifiedRows{Rows: rows, q: q}, nil
}

// query is a statement as it was asked for, to run it again.
type query struct {
	t    *try
	sql  string
	args []any
}

// run runs the query, again while its tries allow.
func (q query) run() (pgx.Rows, error) {
	for {
		rows, err := q.t.d.p.Query(q.t.ctx, q.sql, q.args...)
		if !q.t.again(err) {
			return rows, err
		}
	}
}

// classifiedRows reports a connection lost while reading rows as fault.Unavailable too:
// pgx's Query often returns at once and the failure comes from Next, Scan or Err (a
// list right after PostgreSQL restarted answered 500 instead of 503). A statement the
// connection had prepared before reports a failed send only then: the first Next runs
// it again.
type classifiedRows struct {
	pgx.Rows
	q       query
	started bool  // Next was called: the query is not run again
	err     error // of running it again
}

func (r *classifiedRows) Next() bool {
	if r.err != nil {
		return false
	}
	first := !r.started
	r.started = true
	if r.Rows.Next() {
		return true
	}
	if !first || !r.q.t.again(r.Rows.Err()) {
		return false
	}
	r.Rows.Close()
	if r.Rows, r.err = r.q.run(); r.err != nil {
		return false
	}
	r.started = false // its first row again
	return r.Next()
}

func (r *classifiedRows) Err() error {
	if r.err != nil {
		return unavailable(r.err)
	}
	return unavailable(r.Rows.Err())
}

func (r *classifiedRows) Scan(dest ...any) error { return unavailable(r.Rows.Scan(dest...)) }

func (d db) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return row{r: d.p.QueryRow(ctx, sql, args...), q: query{d.reading(ctx, sql), sql, args}}
}

// row is a QueryRow's row; it runs again as a statement does (try.again).
type row struct {
	r pgx.Row
	q query
}

func (r row) Scan(dest ...any) error {
	err := r.r.Scan(dest...)
	for r.q.t.again(err) {
		err = r.q.t.d.p.QueryRow(r.q.t.ctx, r.q.sql, r.q.args...).Scan(dest...)
	}
	return unavailable(err)
}

// Begin starts a transaction (pgx.BeginFunc's way in), waiting for PostgreSQL as a
// statement does, and again on a fresh connection if the first was dropped: a BEGIN
// changes nothing, so it is also begun again when the connection failed after it was
// sent (PostgreSQL ended the session meanwhile).
func (d db) Begin(ctx context.Context) (pgx.Tx, error) {
	t := d.try(ctx)
	for {
		tx, err := d.p.Begin(ctx)
		if !t.after(err, d.dropped) {
			return tx, err
		}
	}
}

// dropped reports whether err is the connection failing (PostgreSQL went away, before
// or after the statement reached it), for statements that change nothing, and drops
// the pool's stale connections.
func (d db) dropped(ctx context.Context, err error) bool {
	if ctx.Err() != nil || fault.KindOf(unavailable(err)) != fault.Unavailable {
		return false
	}
	d.p.Reset()
	return true
}

// unavailable marks errors that mean the database cannot be reached (as opposed to a
// query's own failure) as fault.Unavailable.
func unavailable(err error) error {
	if err == nil || errors.Is(err, pgx.ErrNoRows) || fault.KindOf(err) != fault.Internal {
		return err
	}
	var ce *pgconn.ConnectError
	var ne net.Error
	var pe *pgconn.PgError
	switch {
	case errors.As(err, &pe):
		// A server error: 57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot
		// connect now, 08xxx connection exceptions are the database going away.
		if strings.HasPrefix(pe.Code, "57P") || strings.HasPrefix(pe.Code, "08") {
			return dbUnavailable(err)
		}
		return err
	case errors.As(err, &ce), errors.As(err, &ne), pgconn.SafeToRetry(err),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNREFUSED),
		errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE), strings.Contains(err.Error(), "conn closed"):
		return dbUnavailable(err)
	}
	return err
}

// dbUnavailable is the fault.Unavailable of a database that cannot be reached. Clients
// are told only that, with a Retry-After of a second (a restart of the embedded
// PostgreSQL takes about that long); the driver's words, which name the database's
// user, name and socket path, go to the log with the error.
func dbUnavailable(err error) error {
	return fault.Later(fault.Redacted(fault.Unavailable, "database unavailable, retry shortly", err), time.Second)
}

// Config configures Open.
type Config struct {
	URL      string
	MaxConns int32
	// Wait is how long a statement waits for PostgreSQL to come back before it fails
	// as unavailable: 0 is DefaultWait, a negative value does not wait.
	Wait   time.Duration
	Logger *slog.Logger
}

// Open connects to PostgreSQL and applies pending migrations.
func Open(ctx context.Context, cfg Config) (*Store, error) {
	pcfg, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse database url: %w", err)
	}
	if cfg.MaxConns > 0 {
		pcfg.MaxConns = cfg.MaxConns
	} else if pcfg.MaxConns < 16 {
		pcfg.MaxConns = 16
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("connect database: %w", err)
	}
	if cfg.Wait == 0 {
		cfg.Wait = DefaultWait
	}
	s := &Store{pool: db{pool, cfg.Wait}, url: cfg.URL, log: cfg.Logger}
	if err := s.migrate(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	return s, nil
}

func (s *Store) migrate(ctx context.Context) error {
	sqlDB := stdlib.OpenDBFromPool(s.pool.p)
	defer sqlDB.Close()
	sub, err := fs.Sub(migrations, "migrations")
	if err != nil {
		return err
	}
	locker, err := lock.NewPostgresSessionLocker()
	if err != nil {
		return fmt.Errorf("migration locker: %w", err)
	}
	p, err := goose.NewProvider(goose.DialectPostgres, sqlDB, sub, goose.WithSessionLocker(locker))
	if err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	res, err := p.Up(ctx)
	if err != nil {
		return fmt.Errorf("apply migrations: %w", err)
	}
	for _, r := range res {
		s.log.Info("applied migration", "version", r.Source.Version, "file", r.Source.Path, "took", r.Duration)
	}
	return nil
}

// DB returns a database/sql handle for tools that need one.
func (s *Store) DB() *sql.DB { return stdlib.OpenDBFromPool(s.pool.p) }

// Close closes the pool.
func (s *Store) Close() { s.pool.p.Close() }

// Ping checks the database answers.
func (s *Store) Ping(ctx context.Context) error { return unavailable(s.pool.p.Ping(ctx)) }

// Connect opens a dedicated connection (for LISTEN or advisory locks).
func (s *Store) Connect(ctx context.Context) (*pgx.Conn, error) {
	return pgx.ConnectConfig(ctx, s.pool.p.Config().ConnConfig.Copy())
}

// querier is what both the pool and a transaction offer.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Tx is a transaction with the store's queries.
type Tx struct {
	tx pgx.Tx
}

// InTx runs fn in a transaction, committing if fn returns nil.
func (s *Store) InTx(ctx context.Context, fn func(tx *Tx) error) error {
	return unavailable(pgx.BeginFunc(ctx, s.pool, func(t pgx.Tx) error { return fn(&Tx{tx: t}) }))
}

func notFound(err error, what string, id string) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fault.New(fault.NotFound, "%s %q not found", what, id)
	}
	return err
}

func isForeignKeyViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23503"
}

func isUniqueViolation(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23505"
}
