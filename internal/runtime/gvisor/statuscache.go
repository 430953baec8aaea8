package gvisor

import (
	"slices"
	"strings"
	"sync"

	"github.com/spacedev/space/internal/runtime/instances"
)

// statusCache keeps what `runsc state` last said about each running or paused
// instance, so that Status costs a read of /proc/<pid>/stat instead of a runsc process
// (10–25 ms here) while nothing has changed. The node observes a sandbox before every
// step it plans; a warm-pool claim waited for that process.
//
// Only this runtime changes its instances through runsc, and every runsc command that
// may change one drops the cached state of each instance it names when it starts and
// again when it ends (change; a command that names none drops them all): a state read
// that overlaps a change of its instance is not kept, so the cache never holds a
// status older than the instance's last change. What happens without runsc — a sandbox
// process that dies or is killed — shows in /proc, which every hit reads: a hit needs
// the same sandbox process (pid and start time) alive.
//
// It also knows the instances this runtime destroyed (gone), until a change of the
// instance begins (a record claimed for a new one, any runsc command naming it): a
// suspended sandbox's Status then costs no runsc state and runsc list (two processes,
// 40–60 ms here, which a wake waited for before it began).
type statusCache struct {
	mu  sync.Mutex
	gen uint64
	// destroyed holds the instances Destroy removed and nothing has named since.
	destroyed map[string]bool
	// exited holds the instances whose sandbox process this runtime saw exit after a
	// checkpoint, and that nothing has named since: Destroy need not signal them nor
	// look for a container a crashed runsc create registered late.
	exited map[string]bool
	// last is the generation of each instance's last change; floor that of a change
	// of all (or of the last time last was emptied to bound it).
	last  map[string]uint64
	floor uint64
	m     map[string]cachedState
	// clean holds the instances whose runsc run or restore this runtime saw end
	// successfully, and that no Create or Restore has claimed again since: no runsc
	// of theirs that a killed caller left running can register them after a delete,
	// so Destroy needs no second look in runsc list. Unlike the rest it survives
	// changes (pause, resume, checkpoints); a node that restarts starts without it.
	clean map[string]bool
}

type cachedState struct {
	st    containerState
	start uint64 // the sandbox process's start time (/proc/PID/stat)
}

// maxTracked bounds the cache: past it, it starts again empty.
const maxTracked = 4096

// get returns the cached state of id if its sandbox process is still the one it was
// and alive, and the generation to hand to put after asking runsc.
func (c *statusCache) get(id string) (containerState, bool, uint64) {
	e, ok, gen := c.lookup(id)
	return e.st, ok, gen
}

// lookup is get with the sandbox process's start time.
func (c *statusCache) lookup(id string) (cachedState, bool, uint64) {
	c.mu.Lock()
	e, ok := c.m[id]
	gen := c.gen
	c.mu.Unlock()
	if !ok {
		return cachedState{}, false, gen
	}
	if p, err := instances.ReadProc(e.st.PID); err != nil || !p.Live() || p.StartTime != e.start {
		c.mu.Lock()
		delete(c.m, id)
		c.mu.Unlock()
		return cachedState{}, false, gen
	}
	return e, true, gen
}

// put keeps st for id unless a change of id began or ended since gen was read. Only
// running and paused states with a live sandbox process are kept: anything else is
// read from runsc every time.
func (c *statusCache) put(id string, st containerState, gen uint64) {
	c.keep(id, st, gen, 0)
}

// moved keeps, for an instance that a runsc command has just moved to status (pause:
// paused, resume: running) and whose commands have all ended, the state it had before
// that command (looked up then) with that status — provided its sandbox process is
// still the one it was (pid and start time). The node observes every instance after
// such a step; this saves that observation its runsc state.
func (c *statusCache) moved(id string, before cachedState, status string) {
	st := before.st
	st.Status = status
	c.keep(id, st, c.generation(), before.start)
}

// keep is put, also requiring the sandbox process's start time to be start when start
// is not 0.
func (c *statusCache) keep(id string, st containerState, gen, start uint64) {
	if (st.Status != "running" && st.Status != "paused") || st.PID <= 0 {
		return
	}
	p, err := instances.ReadProc(st.PID)
	if err != nil || !p.Live() || (start != 0 && p.StartTime != start) {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen < c.floor || gen < c.last[id] {
		return
	}
	if c.m == nil {
		c.m = map[string]cachedState{}
	}
	if len(c.m) >= maxTracked {
		clear(c.m)
	}
	c.m[id] = cachedState{st: st, start: p.StartTime}
}

// generation is the cache's current generation: a put of a state read after every
// change began and ended before this call.
func (c *statusCache) generation() uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.gen
}

// change drops the cached state of ids (of every instance when ids is empty) for a
// runsc command that may change them; the returned func drops it again when the
// command has ended.
func (c *statusCache) change(ids []string) func() {
	mark := func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		c.gen++
		if len(ids) == 0 || len(c.last) >= maxTracked {
			c.floor = c.gen
			c.last, c.m, c.destroyed, c.exited, c.clean = nil, nil, nil, nil, nil
			if len(ids) == 0 {
				return
			}
		}
		if c.last == nil {
			c.last = map[string]uint64{}
		}
		for _, id := range ids {
			c.last[id] = c.gen
			delete(c.m, id)
			delete(c.destroyed, id)
			delete(c.exited, id)
		}
	}
	mark()
	return mark
}

// changes reports whether a runsc invocation (global flags and all) may change an
// instance, and the instance ids it names (every argument that looks like one: a
// few more, like "pids", do no harm).
func changes(args []string) (bool, []string) {
	i := slices.IndexFunc(args, func(a string) bool { return !strings.HasPrefix(a, "-") })
	if i < 0 {
		return false, nil // --version and the like
	}
	switch args[i] {
	case "state", "list", "ps", "flags", "help", "spec":
		return false, nil
	}
	var ids []string
	for _, a := range args[i+1:] {
		if validID(a) {
			ids = append(ids, a)
		}
	}
	return true, ids
}

// gone records that id's instance was destroyed: Status reports it not found without
// asking runsc until a change of id begins. The node never changes one sandbox from two
// goroutines, so nothing makes the instance again between the destroy and this call.
func (c *statusCache) gone(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.goneLocked(id)
}

// goneLocked marks id destroyed (c.mu held).
func (c *statusCache) goneLocked(id string) {
	delete(c.m, id)
	delete(c.exited, id)
	delete(c.clean, id)
	c.destroyed = addBounded(c.destroyed, id)
}

// absent records that id has no instance — no record, and runsc did not list it — as
// seen by a look that began at generation gen: unless a change of id began since (a
// Create claiming its record meanwhile), Status, Destroy and Create treat it as gone
// until the next change.
func (c *statusCache) absent(id string, gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if gen < c.floor || gen < c.last[id] {
		return
	}
	c.goneLocked(id)
}

// isGone reports whether id's instance is known destroyed.
func (c *statusCache) isGone(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.destroyed[id]
}

// stopped records that id's sandbox process exited after a checkpoint this runtime
// took (the instance is stopped, nothing runs in it), until a change of id begins.
func (c *statusCache) stopped(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.exited = addBounded(c.exited, id)
}

// isStopped reports whether id's instance is known stopped by its checkpoint.
func (c *statusCache) isStopped(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.exited[id]
}

// startedClean records that a runsc run or restore of id ended successfully (see
// clean).
func (c *statusCache) startedClean(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.clean = addBounded(c.clean, id)
}

// making records that a new instance of id is being made: it is not clean until its
// start ends.
func (c *statusCache) making(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.clean, id)
}

// isClean reports whether id's instance is known clean (see clean).
func (c *statusCache) isClean(id string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.clean[id]
}

// addBounded adds id to set, starting it afresh (nil, or past maxTracked) first: the
// sets only ever save work, so forgetting them costs a runsc process, never a wrong
// answer.
func addBounded(set map[string]bool, id string) map[string]bool {
	if set == nil || len(set) >= maxTracked {
		set = map[string]bool{}
	}
	set[id] = true
	return set
}
