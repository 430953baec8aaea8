package node

import (
	"sync"
	"time"

	"github.com/spacedev/space/internal/store"
)

// timelines holds the phases a node reaches while it carries out a sandbox's
// transition (create, resume, wake, …). finishOps writes them onto the operations it
// completes, in the statement that completes them: recording costs no round trip.
// The zero value is ready to use.
type timelines struct {
	mu sync.Mutex
	m  map[string][]store.Mark
}

// begin starts a new timeline for sandbox id with the phase "node" (the node began).
func (t *timelines) begin(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.m == nil {
		t.m = map[string][]store.Mark{}
	}
	t.m[id] = []store.Mark{{Phase: "node", At: time.Now()}}
}

// mark records that sandbox id reached phase (ignored outside a timeline).
func (t *timelines) mark(id, phase string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l, ok := t.m[id]; ok && len(l) < maxMarks {
		t.m[id] = append(l, store.Mark{Phase: phase, At: time.Now()})
	}
}

// take returns and forgets sandbox id's timeline.
func (t *timelines) take(id string) []store.Mark {
	t.mu.Lock()
	defer t.mu.Unlock()
	l := t.m[id]
	delete(t.m, id)
	return l
}

// maxMarks bounds one timeline (a transition that loops cannot grow it without end).
const maxMarks = 32
