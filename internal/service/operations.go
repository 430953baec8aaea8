package service

import (
	"context"
	"sync"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// opWatch wakes operation waiters when an operation changes.
type opWatch struct {
	mu      sync.Mutex
	waiters map[string][]chan struct{}
}

func newOpWatch() *opWatch { return &opWatch{waiters: map[string][]chan struct{}{}} }

// wait returns a channel closed at the next change of operation id.
func (o *opWatch) wait(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{})
	o.mu.Lock()
	o.waiters[id] = append(o.waiters[id], ch)
	o.mu.Unlock()
	return ch, func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		list := o.waiters[id]
		for i, c := range list {
			if c == ch {
				o.waiters[id] = append(list[:i], list[i+1:]...)
				break
			}
		}
		if len(o.waiters[id]) == 0 {
			delete(o.waiters, id)
		}
	}
}

// notify wakes the waiters of id; an empty id (after a reconnect) wakes everyone.
func (o *opWatch) notify(id string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	wake := func(k string) {
		for _, c := range o.waiters[k] {
			close(c)
		}
		delete(o.waiters, k)
	}
	if id == "" {
		for k := range o.waiters {
			wake(k)
		}
		return
	}
	wake(id)
}

// Operation returns an operation p may see (404 otherwise).
func (s *Service) Operation(ctx context.Context, p *Principal, id string) (*store.Operation, error) {
	op, err := s.st.GetOperation(ctx, id)
	if err != nil {
		return nil, err
	}
	if !p.Visible(op.Tenant) {
		return nil, fault.New(fault.NotFound, "operation %q not found", id)
	}
	return op, nil
}

// WaitDone waits until operation id (which p may see) is done or ctx ends, and returns
// its latest state (done or not: the caller checks).
func (s *Service) WaitDone(ctx context.Context, p *Principal, id string) (*store.Operation, error) {
	if _, err := s.Operation(ctx, p, id); err != nil {
		return nil, err
	}
	return s.waitOp(ctx, id, func(o *store.Operation) bool { return o.DoneAt != nil })
}

// WaitChange waits until operation id (which p may see) differs from prev (its
// UpdatedAt moved) or ctx ends, and returns its latest state.
func (s *Service) WaitChange(ctx context.Context, id string, prev time.Time) (*store.Operation, error) {
	return s.waitOp(ctx, id, func(o *store.Operation) bool { return !o.UpdatedAt.Equal(prev) })
}

// waitOp returns the operation once done(op) holds or ctx ends (then it returns the
// latest state without error).
func (s *Service) waitOp(ctx context.Context, id string, done func(*store.Operation) bool) (*store.Operation, error) {
	for {
		ch, cancel := s.ops.wait(id)
		op, err := s.st.GetOperation(context.WithoutCancel(ctx), id)
		if err != nil {
			cancel()
			return nil, err
		}
		if done(op) {
			cancel()
			return op, nil
		}
		t := time.NewTimer(operationPollFallback)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			cancel()
			return op, nil
		}
		t.Stop()
		cancel()
	}
}

// OperationLog returns the log lines of operation id after seq (at most limit).
func (s *Service) OperationLog(ctx context.Context, p *Principal, id string, after int64, limit int) ([]store.LogLine, error) {
	if _, err := s.Operation(ctx, p, id); err != nil {
		return nil, err
	}
	lines, err := s.st.OperationLog(ctx, id, after, limit)
	if lines == nil {
		lines = []store.LogLine{}
	}
	return lines, err
}

// maxRecentOperations bounds RecentOperations.
const maxRecentOperations = 500

// RecentOperations lists the newest operations of one kind that p may see (operators:
// every tenant's, or tenant's). Only template builds are listed this way (a sandbox's
// operations are under the sandbox).
func (s *Service) RecentOperations(ctx context.Context, p *Principal, kind, tenant string, limit int) ([]*store.Operation, error) {
	if kind != api.OpTemplateBuild {
		return nil, invalid("kind must be %q (a sandbox's operations are at /v1/sandboxes/{id}/operations)", api.OpTemplateBuild)
	}
	if limit < 1 || limit > maxRecentOperations {
		return nil, invalid("limit must be between 1 and %d", maxRecentOperations)
	}
	scope, err := s.scope(ctx, p, tenant)
	if err != nil {
		return nil, err
	}
	return s.st.RecentOperations(ctx, kind, scope, limit)
}
