package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// Under gVisor the runtime limits the tasks (processes and threads) of the sandbox's
// cgroup inside the Sentry: it writes the cgroup's pids.max after the start, before the
// node asks the agent for anything. The agent shares that limit with every user
// process, and a Go program that cannot start a thread dies: a fork bomb that took
// every task ended the agent (exit 2), which is PID 1, and with it the sandbox, its
// memory and its processes. So the agent splits the cgroup (cgroup v2) at its first
// identity (refresh), before any user process: itself into <cgroup>/agent, user
// processes into <cgroup>/user, whose pids.max leaves agentTasks(limit) of the limit
// to the agent. User processes start inside it (clone3 with CLONE_INTO_CGROUP), so no
// process exists for a moment outside it. After a resume the agent sets the user limit
// again from the sandbox's (a clone may be restored with another limit). In a VM's
// guest, where the agent is init in the root cgroup and nothing limits tasks, user
// processes get a limit of their own (splitRoot). Under a runsc without a pids
// controller inside nothing changes.
//
// Sandbox root can leave the user cgroup (or remove the limit); that only exposes its
// own sandbox's agent, which root can stop anyway. The split protects the sandbox from
// a runaway program, not from its own root.

const (
	// agentCgroupName and userCgroupName are the children of the sandbox's cgroup.
	agentCgroupName = "agent"
	userCgroupName  = "user"
	// maxAgentTasks is the most tasks the split keeps for the agent: it runs about 8
	// threads idle, a few more per busy connection.
	maxAgentTasks = 64
	// minUserTasks is the least a VM guest's user processes get (splitRoot).
	minUserTasks = 256
)

// agentTasks is how many of a limit of limit tasks the agent keeps for itself: a
// quarter of it, at most maxAgentTasks.
func agentTasks(limit int64) int64 { return min(maxAgentTasks, limit/4) }

// taskSplit keeps user processes in their own pids cgroup (see above).
type taskSplit struct {
	root string // the cgroup2 mount; "" disables the split
	log  *slog.Logger
	// self and memTotal default to ownCgroup and memTotalMiB (tests replace them).
	self     func() (string, error)
	memTotal func() (int64, error)

	mu      sync.Mutex
	done    bool     // tried: split (user set) or found nothing to split
	sandbox string   // the sandbox's cgroup directory, once split
	user    *os.File // <sandbox>/user, for CLONE_INTO_CGROUP
	limit   int64    // the sandbox's pids.max the user limit was derived from
}

// userCgroupFD returns the descriptor of the user cgroup new user processes start in,
// splitting the sandbox's cgroup first if that has not been tried (refresh normally
// has); -1 when there is none. A failed split is logged once and leaves processes
// where the agent is.
func (s *taskSplit) userCgroupFD() int {
	if s.root == "" {
		return -1
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.done {
		s.done = true
		if err := s.split(); err != nil {
			s.log.Warn("user processes share the agent's task limit", "err", err)
		}
	}
	if s.user == nil {
		return -1
	}
	return int(s.user.Fd())
}

// lost reports whether the user cgroup new processes start in is gone (sandbox root
// can remove it, or move it away) and, if so, forgets it, so that the next start
// splits again: a start that failed is retried then. A cgroup that is still there
// means the start failed for its own reasons.
func (s *taskSplit) lost() bool {
	if s.root == "" {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.user == nil {
		return false
	}
	var held, named unix.Stat_t
	if unix.Fstat(int(s.user.Fd()), &held) == nil &&
		unix.Stat(filepath.Join(s.sandbox, userCgroupName), &named) == nil &&
		held.Dev == named.Dev && held.Ino == named.Ino {
		return false
	}
	s.log.Warn("the user processes' cgroup is gone; making it again", "cgroup", s.sandbox)
	s.user.Close()
	s.user, s.sandbox, s.done = nil, "", false
	return true
}

// errNoLimit: the agent's cgroup has no pids limit to split.
var errNoLimit = errors.New("no pids limit")

// split moves the agent into <cgroup>/agent and makes <cgroup>/user with its limit.
func (s *taskSplit) split() error {
	own, err := s.self()
	if err != nil {
		return err
	}
	if own == "/" {
		return s.splitRoot()
	}
	dir := filepath.Join(s.root, own)
	if path.Base(own) == agentCgroupName { // split before (a restored agent)
		dir = filepath.Dir(dir)
	}
	limit, err := readPidsMax(dir)
	if errors.Is(err, errNoLimit) || errors.Is(err, fs.ErrNotExist) {
		s.log.Debug("no task limit to share", "cgroup", dir)
		return nil
	}
	if err != nil {
		return err
	}
	if err := os.Mkdir(filepath.Join(dir, agentCgroupName), 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := writeControl(filepath.Join(dir, agentCgroupName, "cgroup.procs"), strconv.Itoa(os.Getpid())); err != nil {
		return err
	}
	if err := s.makeUserCgroup(dir, limit-agentTasks(limit)); err != nil {
		return err
	}
	s.limit = limit
	s.log.Info("user processes limited apart from the agent", "cgroup", dir, "limit", limit, "agent_tasks", agentTasks(limit))
	return nil
}

// makeUserCgroup makes <dir>/user with a pids limit of tasks and opens it for starts.
// Processes other than the agent's must be out of dir first (cgroup v2 hands
// controllers down only from a cgroup without processes, the root excepted).
func (s *taskSplit) makeUserCgroup(dir string, tasks int64) error {
	if err := os.Mkdir(filepath.Join(dir, userCgroupName), 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	if err := writeControl(filepath.Join(dir, "cgroup.subtree_control"), "+pids"); err != nil {
		return err
	}
	if err := writeUserMax(dir, tasks); err != nil {
		return err
	}
	user, err := os.Open(filepath.Join(dir, userCgroupName))
	if err != nil {
		return err
	}
	s.sandbox, s.user = dir, user
	return nil
}

func writeUserMax(dir string, tasks int64) error {
	return writeControl(filepath.Join(dir, userCgroupName, "pids.max"), strconv.FormatInt(tasks, 10))
}

// splitRoot is the split of a VM's guest, where the agent is init in the root cgroup
// and nothing limits the guest's tasks: a fork bomb filled a 512 MiB QEMU guest's memory
// and the guest spent minutes in its OOM killer, the agent unable to answer. User
// processes go into <root>/user with one task per MiB of the guest's memory, at least
// 256 (as a gVisor sandbox's default); the agent stays in the root cgroup, which no
// limit covers.
func (s *taskSplit) splitRoot() error {
	mib, err := s.memTotal()
	if err != nil {
		return err
	}
	limit := max(mib, minUserTasks)
	if err := s.makeUserCgroup(s.root, limit); err != nil {
		return err
	}
	s.limit = 0 // none to follow (refresh)
	s.log.Info("user processes limited", "cgroup", s.root, "limit", limit)
	return nil
}

// memTotalMiB reads MemTotal from /proc/meminfo, in MiB.
func memTotalMiB() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			f := strings.Fields(rest)
			if len(f) > 0 {
				if kb, err := strconv.ParseInt(f[0], 10, 64); err == nil {
					return kb >> 10, nil
				}
			}
		}
	}
	return 0, errors.New("no MemTotal in /proc/meminfo")
}

// refresh runs with every new identity. The first one comes after the runtime has set
// the sandbox's task limit (it does so before Create or Restore returns), so refresh
// splits the cgroup then, before any command asks for a process: the split stays off
// the first command's path (a warm-pool member is split when it is made, not when it
// is claimed). Later, it sets the user limit again when the sandbox's changed (a
// restore with another limit), and tries again where there was none to split.
func (s *taskSplit) refresh() {
	if s.root == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.user == nil {
		if err := s.split(); err != nil && !s.done {
			s.log.Warn("user processes share the agent's task limit", "err", err)
		}
		s.done = true
		return
	}
	if s.sandbox == s.root {
		return // a VM guest's limit follows its memory, which a restore keeps
	}
	limit, err := readPidsMax(s.sandbox)
	if err != nil || limit == s.limit {
		return
	}
	if err := writeUserMax(s.sandbox, limit-agentTasks(limit)); err != nil {
		s.log.Warn("set the user processes' task limit", "err", err)
		return
	}
	s.limit = limit
}

// ownCgroup is the agent's cgroup v2 path (from /proc/self/cgroup).
func ownCgroup() (string, error) {
	b, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		if p, ok := strings.CutPrefix(sc.Text(), "0::"); ok {
			return p, nil
		}
	}
	return "", errors.New("no cgroup v2 entry in /proc/self/cgroup")
}

// readPidsMax reads dir/pids.max; errNoLimit for "max".
func readPidsMax(dir string) (int64, error) {
	b, err := os.ReadFile(filepath.Join(dir, "pids.max"))
	if err != nil {
		return 0, err
	}
	v := strings.TrimSpace(string(b))
	if v == "max" {
		return 0, errNoLimit
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("pids.max %q", v)
	}
	return n, nil
}

func writeControl(file, value string) error {
	if err := os.WriteFile(file, []byte(value), 0); err != nil {
		return fmt.Errorf("write %s: %w", file, err)
	}
	return nil
}
