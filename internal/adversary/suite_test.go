package adversary

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/e2e/e2etest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m, maybeProbe) }

// Bounds of the neighbour's service while an attack runs.
const (
	// slowdownLimit is how much slower than the quiet baseline the neighbour's p95s may
	// get under attack.
	slowdownLimit = 2
	// latencyFloor is the least baseline a p95 is compared against: on a shared 2-core
	// machine a quiet p95 of a few milliseconds doubles from noise alone.
	latencyFloor = 50 * time.Millisecond
	// baselineSamples is the number of quiet samples the baseline is made of.
	baselineSamples = 80
	// minAttackSamples is the least number of samples of a window under attack.
	minAttackSamples = 60
	// diskReserve is the server's --disk-reserve (its default).
	diskReserve = 0.10
)

// suite is what every attack shares: one server, one neighbour sandbox, the baseline.
type suite struct {
	s         *e2etest.Server
	neighbour string
	baseline  latencies

	mu      sync.Mutex
	figures []string
}

// latencies are p95s of one window.
type latencies struct {
	exec, get time.Duration
	samples   int
}

func (l latencies) String() string {
	return fmt.Sprintf("exec p95 %v, GET p95 %v (%d samples)", l.exec.Round(time.Millisecond), l.get.Round(time.Millisecond), l.samples)
}

// TestAdversarial runs every attack, one after the other, against one server and one
// neighbour. Each attack is a subtest (go test -run 'TestAdversarial/ForkBomb').
func TestAdversarial(t *testing.T) {
	s := e2etest.Start(t, e2etest.Options{})
	su := &suite{s: s}
	nb := su.create(t, api.CreateSandboxRequest{})
	su.neighbour = nb.ID
	// Warm the paths the prober takes, then measure the quiet baseline.
	for range 5 {
		su.probeOnce(t)
	}
	p := su.startProber(t)
	for p.count() < baselineSamples {
		if err := p.wait(30 * time.Second); err != nil {
			t.Fatalf("baseline: %v", err)
		}
	}
	su.baseline = p.stop(t)
	t.Logf("quiet baseline: %v", su.baseline)
	su.figure("baseline", su.baseline.String())

	for _, a := range attacks {
		t.Run(a.name, func(t *testing.T) { su.underAttack(t, a.run, a.knownSlow) })
	}
	su.mu.Lock()
	defer su.mu.Unlock()
	t.Logf("figures (neighbour p95s; limit %d× max(baseline, %v)):\n%s", slowdownLimit, latencyFloor, strings.Join(su.figures, "\n"))
}

// attacks are run in this order.
var attacks = []struct {
	name string
	run  func(t *testing.T, su *suite)
	// knownSlow, when set, names the known issue by which this attack slows the
	// neighbour beyond the limit: a violation is logged, not failed.
	knownSlow string
}{
	{"SetuidAndDeviceNodes", attackSetuidAndDeviceNodes, ""},
	{"ProcSysDevProbing", attackProbing, ""},
	{"LinkTricksThroughFilesAPI", attackLinks, ""},
	{"AgentImpersonationAfterRestore", attackImpersonation, ""},
	{"ForkBomb", attackForkBomb, "a fork bomb (about 1,000 guest processes, 4,251 host tasks: systrap stubs, created by the host kernel) slowed the neighbour's exec p95 to 105 ms against a 31 ms baseline on 2 cores in one CI run (2.1× the 50 ms floor); most runs stay under 2×"},
	{"TaskCgroupRemoved", attackTaskCgroupRemoved, ""},
	{"MemoryHog", attackMemoryHog, "a sandbox reclaiming and OOM-killed at its memory limit slowed the neighbour's exec p95 to 2.8× (255 ms against 91 ms) on 2 cores: no CPU or memory-pressure isolation beyond the cgroup limits"},
	{"MemoryFilesFill", attackMemoryFilesFill, ""},
	{"DiskWriteBeyondMemory", attackDiskWriteBeyondMemory, ""},
	{"DiskFill", attackDiskFill, ""},
	{"OutputFlood", attackOutputFlood, "a sandbox writing output as fast as it can (1 CPU of 2) slowed the neighbour's exec p95 to 4.2× (415 ms against 98 ms)"},
	{"LogFlood", attackLogFlood, ""},
	{"ThousandsOfSessions", attackSessions, "8 sessions at a time of `true` (each a process start costing the attacker's sandbox about 11 ms of CPU, and the server the API and relay work of each, which no tenant's quota bounds) slowed the neighbour's exec p95 to 3.0–3.4× (222–228 ms against 67–75 ms) on 2 cores in two of four CI runs on a machine where runsc starts twice as slowly as before"},
}

func (su *suite) figure(name, text string) {
	su.mu.Lock()
	defer su.mu.Unlock()
	su.figures = append(su.figures, fmt.Sprintf("  %-32s %s", name, text))
}

// underAttack runs one attack while the prober measures the neighbour, then checks the
// neighbour's p95s against the baseline and the host's free disk against the reserve.
// The machine is shared and noisy: a window above the limit is confirmed before it
// fails, by a quiet window (if the neighbour is as slow without the attack, the load
// came from elsewhere and the quiet window is the reference) and by running the attack
// once more. Only a slowdown seen in both runs is the attack's.
func (su *suite) underAttack(t *testing.T, attack func(t *testing.T, su *suite), knownSlow string) {
	name := t.Name()[len("TestAdversarial/"):]
	ref := su.baseline
	over := func(got latencies) bool {
		return got.exec > slowdownLimit*max(ref.exec, latencyFloor) || got.get > slowdownLimit*max(ref.get, latencyFloor)
	}
	got, minFree := su.attackWindow(t, attack)
	su.figure(name, fmt.Sprintf("%v; min free disk %.1f%%", got, 100*minFree))
	t.Logf("neighbour under attack: %v (baseline %v); min free disk %.1f%%", got, su.baseline, 100*minFree)
	if over(got) {
		q := su.startProber(t)
		for q.count() < baselineSamples/2 {
			if err := q.wait(30 * time.Second); err != nil {
				t.Fatalf("quiet window: %v", err)
			}
		}
		quiet := q.stop(t)
		t.Logf("quiet window after the attack: %v", quiet)
		su.figure("  quiet window after "+name, quiet.String())
		ref.exec, ref.get = max(ref.exec, quiet.exec), max(ref.get, quiet.get)
	}
	if over(got) && knownSlow == "" && !t.Failed() {
		again, free2 := su.attackWindow(t, attack)
		t.Logf("the attack again: %v; min free disk %.1f%%", again, 100*free2)
		su.figure("  "+name+" again", again.String())
		got.exec, got.get = min(got.exec, again.exec), min(got.get, again.get)
		minFree = min(minFree, free2)
	}
	fail := t.Errorf
	if knownSlow != "" {
		fail = func(format string, args ...any) { t.Logf("known issue ("+knownSlow+"): "+format, args...) }
	}
	if limit := slowdownLimit * max(ref.exec, latencyFloor); got.exec > limit {
		fail("neighbour exec p95 %v under attack, above %v (reference %v)", got.exec, limit, ref.exec)
	}
	if limit := slowdownLimit * max(ref.get, latencyFloor); got.get > limit {
		fail("API p95 %v under attack, above %v (reference %v)", got.get, limit, ref.get)
	}
	if minFree < diskReserve {
		t.Errorf("the host's free disk dropped to %.1f%%, below the %.0f%% reserve", 100*minFree, 100*diskReserve)
	}
}

// attackWindow runs the attack once under the prober and returns the neighbour's
// p95s over the window and the least free disk seen.
func (su *suite) attackWindow(t *testing.T, attack func(t *testing.T, su *suite)) (latencies, float64) {
	p := su.startProber(t)
	stopped := false
	defer func() {
		if !stopped {
			p.stop(t)
		}
	}()
	attack(t, su)
	// Short attacks: keep measuring until the window has enough samples for a p95 that
	// is not just the slowest one.
	for p.count() < minAttackSamples {
		if err := p.wait(30 * time.Second); err != nil {
			t.Fatalf("neighbour: %v", err)
		}
	}
	got := p.stop(t)
	stopped = true
	return got, p.minFree
}

// prober measures the neighbour in the background: one exec in it and one
// GET /v1/sandboxes/{id} per round, and the free disk of the store and of the host file
// system under the data directory.
type prober struct {
	su      *suite
	cancel  context.CancelFunc
	done    chan struct{}
	mu      sync.Mutex
	execs   []time.Duration
	gets    []time.Duration
	errs    []error
	tick    chan struct{}
	minFree float64
}

// probeRound is the pause between two rounds: the neighbour's workload is steady, not
// a flood of its own.
const probeRound = 50 * time.Millisecond

func (su *suite) startProber(t *testing.T) *prober {
	ctx, cancel := context.WithCancel(context.Background())
	p := &prober{su: su, cancel: cancel, done: make(chan struct{}), tick: make(chan struct{}, 1), minFree: 1}
	go func() {
		defer close(p.done)
		for ctx.Err() == nil {
			e, g, err := su.measure(ctx)
			free := su.freeDisk()
			p.mu.Lock()
			p.minFree = min(p.minFree, free)
			if err != nil && ctx.Err() == nil {
				p.errs = append(p.errs, err)
			} else if err == nil {
				p.execs = append(p.execs, e)
				p.gets = append(p.gets, g)
			}
			p.mu.Unlock()
			select {
			case p.tick <- struct{}{}:
			default:
			}
			select {
			case <-ctx.Done():
			case <-time.After(probeRound):
			}
		}
	}()
	return p
}

func (p *prober) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.execs)
}

// wait waits for the next round (or fails after d, or when the probe keeps failing).
func (p *prober) wait(d time.Duration) error {
	select {
	case <-p.tick:
	case <-time.After(d):
		return fmt.Errorf("no probe round finished within %v", d)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.errs) > 3 {
		return fmt.Errorf("probes fail: %v", p.errs)
	}
	return nil
}

// stop ends the prober and returns its p95s; probe errors fail the test.
func (p *prober) stop(t *testing.T) latencies {
	t.Helper()
	p.cancel()
	<-p.done
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, err := range p.errs {
		t.Errorf("neighbour probe failed: %v", err)
	}
	return latencies{exec: p95(p.execs), get: p95(p.gets), samples: len(p.execs)}
}

func p95(d []time.Duration) time.Duration {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	return s[(len(s)*95+99)/100-1]
}

// measure runs one exec in the neighbour and one GET of it.
func (su *suite) measure(ctx context.Context) (execTime, getTime time.Duration, err error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	var out bytes.Buffer
	t0 := time.Now()
	code, err := su.s.C.Exec(ctx, su.neighbour, api.CreateSessionRequest{Argv: []string{"cat", "/proc/self/stat"}}, client.Output{Stdout: &out, Stderr: &out})
	execTime = time.Since(t0)
	if err != nil {
		return 0, 0, fmt.Errorf("exec in the neighbour: %w", err)
	}
	if code != 0 || !strings.Contains(out.String(), "(cat)") {
		return 0, 0, fmt.Errorf("exec in the neighbour: exit %d, %q", code, out.String())
	}
	t0 = time.Now()
	sb, err := su.s.C.GetSandbox(ctx, su.neighbour)
	getTime = time.Since(t0)
	if err != nil {
		return 0, 0, fmt.Errorf("GET the neighbour: %w", err)
	}
	if sb.State != api.StateRunning {
		return 0, 0, fmt.Errorf("the neighbour is %s", sb.State)
	}
	return execTime, getTime, nil
}

func (su *suite) probeOnce(t *testing.T) {
	t.Helper()
	if _, _, err := su.measure(e2etest.Ctx(t, time.Minute)); err != nil {
		t.Fatal(err)
	}
}

// freeDisk returns the least free fraction of the store's file system and of the host
// file system that holds the data directory (and the store's image).
func (su *suite) freeDisk() float64 {
	least := 1.0
	for _, dir := range []string{su.s.DataDir, filepath.Join(su.s.DataDir, "store")} {
		var st unix.Statfs_t
		if unix.Statfs(dir, &st) != nil || st.Blocks == 0 {
			continue
		}
		least = min(least, float64(st.Bavail)/float64(st.Blocks))
	}
	return least
}

// create makes a sandbox that is deleted when t ends.
func (su *suite) create(t *testing.T, req api.CreateSandboxRequest) *api.Sandbox {
	t.Helper()
	sb := su.s.Create(t, req)
	t.Cleanup(func() {
		if _, err := su.s.C.DeleteSandbox(context.Background(), sb.ID); err != nil {
			t.Logf("delete %s: %v", sb.ID, err)
		}
	})
	return sb
}

// sh runs a shell command as root in sandbox id and returns its combined output and
// exit code.
func (su *suite) sh(t *testing.T, id, command string) (string, int) {
	t.Helper()
	var out bytes.Buffer
	w := &lockedBuffer{b: &out}
	code, err := su.s.C.Exec(e2etest.Ctx(t, 2*time.Minute), id, api.CreateSessionRequest{Command: command}, client.Output{Stdout: w, Stderr: w})
	if err != nil {
		t.Fatalf("exec %q in %s: %v", command, id, err)
	}
	return w.String(), code
}

// mustSh is sh that fails the test on a non-zero exit.
func (su *suite) mustSh(t *testing.T, id, command string) string {
	t.Helper()
	out, code := su.sh(t, id, command)
	if code != 0 {
		t.Fatalf("%q in %s: exit %d: %s", command, id, code, out)
	}
	return out
}

// put writes a file into sandbox id through the files API.
func (su *suite) put(t *testing.T, id, path, content string, mode uint32) {
	t.Helper()
	if _, err := su.s.C.WriteFile(e2etest.Ctx(t, time.Minute), id, path, strings.NewReader(content), client.FileOptions{Mode: mode}); err != nil {
		t.Fatalf("write %s into %s: %v", path, id, err)
	}
}

type lockedBuffer struct {
	mu sync.Mutex
	b  *bytes.Buffer
}

func (w *lockedBuffer) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *lockedBuffer) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// rssKB returns a process's resident set size.
func rssKB(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
			n, _ := strconv.Atoi(f[1])
			return n
		}
	}
	return 0
}

// rssWatch samples the server's RSS every 100 ms until stopped and returns the peak.
func (su *suite) rssWatch() (stop func() int) {
	pid := su.s.Pid()
	done := make(chan struct{})
	peak := make(chan int, 1)
	go func() {
		m := rssKB(pid)
		for {
			select {
			case <-done:
				peak <- max(m, rssKB(pid))
				return
			case <-time.After(100 * time.Millisecond):
				m = max(m, rssKB(pid))
			}
		}
	}()
	return func() int { close(done); return <-peak }
}

// hostCgroupFile is a file of the host cgroup of a gVisor sandbox (v1 or v2).
func hostCgroupFile(id, controller, v1name, v2name string) string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		return filepath.Join("/sys/fs/cgroup/space", id, v2name)
	}
	return filepath.Join("/sys/fs/cgroup", controller, "space", id, v1name)
}

func readInt64(t *testing.T, path string) int64 {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	s := strings.TrimSpace(string(b))
	if s == "max" {
		return -1
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return n
}
