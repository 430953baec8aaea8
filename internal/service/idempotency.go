package service

import (
	"context"
	"encoding/json"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/store"
)

// Idempotency identifies a request made with an Idempotency-Key: the same key with the
// same method, path and body gets the first request's answer; with another request it
// is refused (422). Creates, lifecycle verbs, clones, snapshots and template builds
// take one (command sessions and execs keep theirs in the agent: processKey).
type Idempotency struct {
	Key      string
	Method   string
	Path     string
	BodyHash []byte
}

// maxIdempotencyKey bounds Idempotency-Key.
const maxIdempotencyKey = 255

// Answer is what a request that makes or changes something answers: its status and
// JSON body. With an Idempotency-Key it is recorded in the transaction that makes the
// change, so that a crash cannot separate the two, and a retry gets it back.
type Answer struct {
	Status int
	Body   []byte
	// Location is the path of what the request made ("" for none, and on a replay).
	Location string
	// Replayed is true when Body is the recorded answer to an earlier request.
	Replayed bool
}

// once runs do, which makes a change and records its answer (answer), for a request
// with idem (nil: no Idempotency-Key). A request that was answered before gets the
// recorded answer without do running; one that lost a race with a twin (do failed with
// a conflict: the twin's record, or the change the twin made, was in the way) gets the
// twin's answer.
func (s *Service) once(ctx context.Context, p *Principal, idem *Idempotency, do func() (*Answer, error)) (*Answer, error) {
	if idem == nil {
		return do()
	}
	if err := checkKey(idem.Key); err != nil {
		return nil, err
	}
	if prev, err := s.replay(ctx, p, idem); prev != nil || err != nil {
		return prev, err
	}
	a, err := do()
	if err != nil && fault.Is(err, fault.Conflict) {
		if prev, err2 := s.replay(ctx, p, idem); err2 == nil && prev != nil {
			return prev, nil
		}
	}
	return a, err
}

// checkKey refuses an Idempotency-Key longer than maxIdempotencyKey.
func checkKey(key string) error {
	if len(key) > maxIdempotencyKey {
		return invalid("Idempotency-Key is longer than %d characters", maxIdempotencyKey)
	}
	return nil
}

func (s *Service) replay(ctx context.Context, p *Principal, idem *Idempotency) (*Answer, error) {
	prev, err := s.st.LookupIdempotency(ctx, p.Tenant, idem.Key, idem.Method, idem.Path, idem.BodyHash)
	if err != nil || prev == nil {
		return nil, err
	}
	return &Answer{Status: prev.Status, Body: prev.Body, Replayed: true}, nil
}

// answer encodes v as a request's answer with status and, for a request with idem,
// records it in tx (a concurrent twin that recorded first makes this a conflict). The
// caller sets the answer's Location.
func answer(ctx context.Context, tx *store.Tx, p *Principal, idem *Idempotency, status int, v any) (*Answer, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return nil, err
	}
	if idem != nil {
		if err := tx.SaveIdempotency(ctx, p.Tenant, idem.Key, idem.Method, idem.Path, idem.BodyHash, status, b); err != nil {
			return nil, err
		}
	}
	return &Answer{Status: status, Body: b}, nil
}
