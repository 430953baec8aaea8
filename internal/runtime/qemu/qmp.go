package qemu

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
)

// qmp is one connection to QEMU's machine protocol: newline-delimited JSON over the unix
// socket in the instance's state dir. QEMU serves one QMP client at a time, so callers
// hold the instance's lock while they use one, and connections are short-lived.
type qmp struct {
	conn *net.UnixConn
	r    *bufio.Reader
}

// qmpError is an error answer of QEMU.
type qmpError struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

func (e *qmpError) Error() string { return "qmp: " + e.Class + ": " + e.Desc }

// dialQMP connects to the QMP socket, reads the greeting and negotiates capabilities.
func dialQMP(ctx context.Context, path string) (*qmp, error) {
	c, err := dialUnix(ctx, path)
	if err != nil {
		return nil, fmt.Errorf("qmp: %w", err)
	}
	q := &qmp{conn: c.(*net.UnixConn), r: bufio.NewReader(c)}
	var greeting struct {
		QMP json.RawMessage `json:"QMP"`
	}
	stop := q.bind(ctx)
	err = q.read(&greeting)
	stop()
	if err == nil && greeting.QMP == nil {
		err = errors.New("not a QMP greeting")
	}
	if err != nil {
		q.Close()
		return nil, fmt.Errorf("qmp greeting: %w", errors.Join(ctxErr(ctx), err))
	}
	if err := q.exec(ctx, "qmp_capabilities", nil, nil); err != nil {
		q.Close()
		return nil, err
	}
	return q, nil
}

func ctxErr(ctx context.Context) error { return ctx.Err() }

// bind makes ctx's end (and deadline) interrupt the connection's I/O until stop.
func (q *qmp) bind(ctx context.Context) (stop func()) {
	if d, ok := ctx.Deadline(); ok {
		q.conn.SetDeadline(d)
	}
	s := context.AfterFunc(ctx, func() { q.conn.SetDeadline(time.Unix(1, 0)) })
	return func() {
		s()
		q.conn.SetDeadline(time.Time{})
	}
}

func (q *qmp) Close() error { return q.conn.Close() }

// read decodes the next message that is not an event into v.
func (q *qmp) read(v any) error {
	for {
		line, err := q.r.ReadBytes('\n')
		if err != nil {
			return err
		}
		var probe struct {
			Event string `json:"event"`
		}
		if json.Unmarshal(line, &probe) == nil && probe.Event != "" {
			continue
		}
		return json.Unmarshal(line, v)
	}
}

// exec runs one command and decodes its "return" into out (if not nil).
func (q *qmp) exec(ctx context.Context, cmd string, args, out any) error {
	return q.execFD(ctx, cmd, args, out, -1)
}

// execFD runs one command, passing fd (unless -1) along with it (SCM_RIGHTS), as getfd
// and add-fd expect.
func (q *qmp) execFD(ctx context.Context, cmd string, args, out any, fd int) error {
	stop := q.bind(ctx)
	defer stop()
	req := map[string]any{"execute": cmd}
	if args != nil {
		req["arguments"] = args
	}
	data, err := json.Marshal(req)
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, err)
	}
	data = append(data, '\n')
	if fd >= 0 {
		_, _, err = q.conn.WriteMsgUnix(data, unix.UnixRights(fd), nil)
	} else {
		_, err = q.conn.Write(data)
	}
	if err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, errors.Join(ctxErr(ctx), err))
	}
	var resp struct {
		Return json.RawMessage `json:"return"`
		Error  *qmpError       `json:"error"`
	}
	if err := q.read(&resp); err != nil {
		return fmt.Errorf("qmp %s: %w", cmd, errors.Join(ctxErr(ctx), err))
	}
	if resp.Error != nil {
		return fmt.Errorf("qmp %s: %w", cmd, resp.Error)
	}
	if out != nil && resp.Return != nil {
		if err := json.Unmarshal(resp.Return, out); err != nil {
			return fmt.Errorf("qmp %s: decode: %w", cmd, err)
		}
	}
	return nil
}

// runState is QEMU's run state (query-status "status").
func (q *qmp) runState(ctx context.Context) (string, error) {
	var st struct {
		Status string `json:"status"`
	}
	if err := q.exec(ctx, "query-status", nil, &st); err != nil {
		return "", err
	}
	return st.Status, nil
}

// migrationStatus is query-migrate's status ("" before any migration).
func (q *qmp) migrationStatus(ctx context.Context) (string, string, error) {
	var st struct {
		Status    string `json:"status"`
		ErrorDesc string `json:"error-desc"`
	}
	if err := q.exec(ctx, "query-migrate", nil, &st); err != nil {
		return "", "", err
	}
	return st.Status, st.ErrorDesc, nil
}

// waitMigration polls query-migrate until the migration completed or failed.
func (q *qmp) waitMigration(ctx context.Context) error {
	t := time.NewTicker(migratePoll)
	defer t.Stop()
	for {
		st, desc, err := q.migrationStatus(ctx)
		if err != nil {
			return err
		}
		switch st {
		case "completed":
			return nil
		case "failed", "cancelled":
			return fmt.Errorf("migration %s: %s", st, desc)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("migration %s: %w", st, ctx.Err())
		case <-t.C:
		}
	}
}

// migratePoll is how often a running migration is polled.
const migratePoll = 5 * time.Millisecond

// dialUnix connects to a unix socket, also when its path is too long for sockaddr_un:
// then through /proc/self/fd/N/NAME, N being an O_PATH descriptor of its directory.
func dialUnix(ctx context.Context, p string) (net.Conn, error) {
	var d net.Dialer
	if len(p) < len(unix.RawSockaddrUnix{}.Path) {
		return d.DialContext(ctx, "unix", p)
	}
	fd, err := unix.Open(filepath.Dir(p), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: filepath.Dir(p), Err: err}
	}
	defer unix.Close(fd)
	return d.DialContext(ctx, "unix", fmt.Sprintf("/proc/self/fd/%d/%s", fd, filepath.Base(p)))
}
