package qemu

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/hashicorp/yamux"

	"github.com/spacedev/space/internal/guest/vmboot"
)

// agentSession is the yamux session to one instance's agent.
type agentSession struct {
	sess *yamux.Session
}

// session returns the instance's agent session, connecting to the agent's port and
// handshaking first if there is none or it died (the VM was restored, the agent
// restarted, or this is a new Runtime after a node restart).
func (r *Runtime) session(ctx context.Context, id string) (*agentSession, error) {
	unlock, err := r.take(ctx, id, func(in *instance) chan struct{} { return in.conn })
	if err != nil {
		return nil, err
	}
	defer unlock()
	r.mu.Lock()
	in := r.insts[id] // kept by take until unlock
	s := in.sess
	r.mu.Unlock()
	if s != nil && !s.sess.IsClosed() {
		return s, nil
	}
	rec, err := r.findInstance(id)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	conn, err := dialUnix(ctx, filepath.Join(rec.StateDir, agentSocket))
	if err != nil {
		return nil, fmt.Errorf("connect agent port: %w", err)
	}
	sess, err := vmboot.Connect(ctx, conn, r.log)
	if err != nil {
		return nil, err
	}
	s = &agentSession{sess: sess}
	r.mu.Lock()
	in.sess = s
	r.mu.Unlock()
	attrs := []any{"id", id, "handshake", time.Since(start)}
	if !rec.CreatedAt.IsZero() {
		attrs = append(attrs, "since_start", time.Since(rec.CreatedAt))
	}
	r.log.InfoContext(ctx, "agent connected", attrs...)
	return s, nil
}

// dropSession closes the instance's agent session (only if it is still s, when s is not
// nil), so that the next Dial reconnects.
func (r *Runtime) dropSession(id string, s *agentSession) {
	r.mu.Lock()
	in := r.insts[id]
	if in == nil || in.sess == nil || (s != nil && in.sess != s) {
		r.mu.Unlock()
		return
	}
	old := in.sess
	in.sess = nil
	if in.refs == 0 {
		delete(r.insts, id)
	}
	r.mu.Unlock()
	old.sess.Close()
}
