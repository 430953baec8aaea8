package bench

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/ids"
	"github.com/spacedev/space/internal/runtime/gvisor"
)

// densityCount is how many idle sandboxes of each kind (fresh boots, default path) the
// density scenario breaks down: the run count, from 2 to 10 (the scale scenario covers
// larger counts).
func densityCount(cfg *Config) int { return max(2, min(cfg.Runs, 10)) }

// settle is how long sandboxes are left idle before their memory is read: the agent's
// and the Sentry's start-up garbage is collected and returned by then.
const settle = 5 * time.Second

// procMem is the memory of one host process (KiB), from /proc/PID/status and
// /proc/PID/smaps_rollup. PSS divides each shared page among the processes mapping it
// (the runsc binary's text, shared by every Sentry and gofer, counts once in total).
type procMem struct {
	RSS, Anon, File, Shmem int
	PSS, PSSAnon, PSSFile  int
	PSSShmem               int
}

func (m *procMem) add(o procMem) {
	m.RSS += o.RSS
	m.Anon += o.Anon
	m.File += o.File
	m.Shmem += o.Shmem
	m.PSS += o.PSS
	m.PSSAnon += o.PSSAnon
	m.PSSFile += o.PSSFile
	m.PSSShmem += o.PSSShmem
}

// readProcMem reads pid's memory; a process that is gone reads as zero.
func readProcMem(pid int) procMem {
	var m procMem
	fields := func(path string, f func(k string, kb int)) {
		fh, err := os.Open(path)
		if err != nil {
			return
		}
		defer fh.Close()
		sc := bufio.NewScanner(fh)
		for sc.Scan() {
			if p := strings.Fields(sc.Text()); len(p) >= 2 {
				if kb, err := strconv.Atoi(p[1]); err == nil {
					f(strings.TrimSuffix(p[0], ":"), kb)
				}
			}
		}
	}
	fields(fmt.Sprintf("/proc/%d/status", pid), func(k string, kb int) {
		switch k {
		case "VmRSS":
			m.RSS = kb
		case "RssAnon":
			m.Anon = kb
		case "RssFile":
			m.File = kb
		case "RssShmem":
			m.Shmem = kb
		}
	})
	fields(fmt.Sprintf("/proc/%d/smaps_rollup", pid), func(k string, kb int) {
		switch k {
		case "Pss":
			m.PSS = kb
		case "Pss_Anon":
			m.PSSAnon = kb
		case "Pss_File":
			m.PSSFile = kb
		case "Pss_Shmem":
			m.PSSShmem = kb
		}
	})
	return m
}

// proc is a host process: its pid, parent and command line.
type proc struct {
	pid, ppid int
	argv      []string
}

func listProcs() []proc {
	ents, _ := os.ReadDir("/proc")
	var out []proc
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil || len(cmd) == 0 {
			continue
		}
		st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// pid (comm) state ppid …: comm may hold spaces, so split after the last ')'.
		rest := st[strings.LastIndexByte(string(st), ')')+1:]
		f := strings.Fields(string(rest))
		if len(f) < 2 || f[0] == "Z" {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		out = append(out, proc{pid: pid, ppid: ppid, argv: strings.Split(strings.TrimRight(string(cmd), "\x00"), "\x00")})
	}
	return out
}

// sandboxProcs finds the host processes of the runsc container id: the Sentry ("runsc
// … boot … ID") with its descendants (the platform's stub processes), and the gofer
// (a runsc "gofer" process whose command line names the container, or a child of the
// Sentry's parent that runs "gofer").
func sandboxProcs(all []proc, id string) (sentry, gofer []int) {
	children := map[int][]int{}
	for _, p := range all {
		children[p.ppid] = append(children[p.ppid], p.pid)
	}
	isRunsc := func(p proc) bool { return strings.Contains(p.argv[0], "runsc") }
	for _, p := range all {
		if !isRunsc(p) || len(p.argv) < 2 {
			continue
		}
		switch {
		case slices.Contains(p.argv, "boot") && p.argv[len(p.argv)-1] == id:
			sentry = append(sentry, p.pid)
		case slices.Contains(p.argv, "gofer") && strings.Contains(strings.Join(p.argv, " "), id):
			gofer = append(gofer, p.pid)
		}
	}
	for i := 0; i < len(sentry); i++ {
		for _, c := range children[sentry[i]] {
			if !slices.Contains(sentry, c) && !slices.Contains(gofer, c) {
				sentry = append(sentry, c)
			}
		}
	}
	return sentry, gofer
}

func sumMem(pids []int) procMem {
	var m procMem
	for _, pid := range pids {
		m.add(readProcMem(pid))
	}
	return m
}

// cgroupMemory reads the memory charged to pid's memory cgroup (KiB; see
// cgroupstat.Memory), or -1.
func cgroupMemory(pid int) int {
	n, err := cgroupstat.Memory(pid)
	if err != nil {
		return -1
	}
	return int(n / 1024)
}

// memAvailable is the host's MemAvailable (KiB).
func memAvailable() int {
	var kb int
	b, _ := os.ReadFile("/proc/meminfo")
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
			kb, _ = strconv.Atoi(f[1])
		}
	}
	return kb
}

// serverPid finds the `space serve` process with dataDir, or 0.
func serverPid(dataDir string) int {
	if dataDir == "" {
		return 0
	}
	for _, p := range listProcs() {
		if slices.Contains(p.argv, "serve") && strings.Contains(strings.Join(p.argv, " "), dataDir) {
			return p.pid
		}
	}
	return 0
}

func mib(kb int) float64 { return float64(kb) / 1024 }

// idleSet is a set of idle sandboxes the density and scale scenarios create.
type idleSet struct {
	cfg  *Config
	ids  []string
	path map[string]string // each sandbox's start path
	sb   map[string]api.Sandbox
}

// grow creates sandboxes like req until the set holds n (a few at a time), and returns
// the create latencies (ms) of the new ones.
func (s *idleSet) grow(ctx context.Context, n int, tag string, req api.CreateSandboxRequest) ([]float64, error) {
	const parallel = 4
	type res struct {
		id, path string
		sb       api.Sandbox
		ms       float64
		err      error
	}
	var lat []float64
	for len(s.ids) < n {
		k := min(parallel, n-len(s.ids))
		ch := make(chan res, k)
		for i := 0; i < k; i++ {
			go func() {
				start := time.Now()
				req := req
				req.Template, req.Metadata = s.cfg.Template, map[string]string{"space-bench": tag}
				sb, err := s.cfg.Client.CreateAndWait(ctx, req)
				r := res{ms: ms(time.Since(start)), err: err}
				if sb != nil {
					r.id, r.path, r.sb = sb.ID, sb.StartPath, *sb
				}
				ch <- r
			}()
		}
		var firstErr error
		for i := 0; i < k; i++ {
			r := <-ch
			if r.id != "" {
				s.ids = append(s.ids, r.id)
				if s.path == nil {
					s.path, s.sb = map[string]string{}, map[string]api.Sandbox{}
				}
				s.path[r.id], s.sb[r.id] = r.path, r.sb
			}
			if r.err != nil && firstErr == nil {
				firstErr = r.err
			}
			if r.err == nil {
				lat = append(lat, r.ms)
			}
		}
		if firstErr != nil {
			return lat, fmt.Errorf("create idle sandbox %d of %d: %w", len(s.ids)+1, n, firstErr)
		}
	}
	return lat, nil
}

// deleteAll deletes the set's sandboxes, a few at a time.
func (s *idleSet) deleteAll(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	sem := make(chan struct{}, 8)
	done := make(chan struct{}, len(s.ids))
	for _, id := range s.ids {
		sem <- struct{}{}
		go func() {
			_ = deleteAndWait(ctx, s.cfg.Client, id)
			<-sem
			done <- struct{}{}
		}()
	}
	for range s.ids {
		<-done
	}
	s.ids = nil
}

// density breaks the host memory of idle sandboxes down: per sandbox the Sentry (with
// the platform's stubs) and the gofer, RSS and PSS, the guest memory inside the Sentry's
// figure (its shared memory file), the agent as the sandbox sees it, the sandbox's
// cgroup, and per sandbox the server's growth and the host's MemAvailable drop. Half
// the sandboxes boot (fresh_boot), half take the default path (the base snapshot, when
// the node uses it): the main figures are reported per start path. The baseline is the
// bare runtime in the same run: `runsc run -detach` of the template's root filesystem
// with runsc's default flags, running `sleep` (what runsc itself costs for an idle
// container).
func density(ctx context.Context, cfg *Config) ([]Result, error) {
	set := &idleSet{cfg: cfg}
	defer set.deleteAll(ctx)
	srv := serverPid(cfg.DataDir)
	srvBefore := readProcMem(srv)
	availBefore := memAvailable()
	if _, err := set.grow(ctx, densityCount(cfg), "density", api.CreateSandboxRequest{FreshBoot: true}); err != nil {
		return nil, err
	}
	if _, err := set.grow(ctx, 2*densityCount(cfg), "density", api.CreateSandboxRequest{}); err != nil {
		return nil, err
	}
	if err := sleepCtx(ctx, settle); err != nil {
		return nil, err
	}
	availAfter := memAvailable()
	srvAfter := readProcMem(srv)
	if set.sb[set.ids[0]].Runtime == "qemu" {
		return qemuDensity(ctx, cfg, set, srvBefore, srvAfter, availBefore-availAfter)
	}
	all := listProcs()
	type byPath struct{ pss, cg, own []float64 }
	paths := map[string]*byPath{}
	var rss, sRSS, sPSS, sGuest, gRSS, gPSS, agent []float64
	for _, id := range set.ids {
		sp, gp := sandboxProcs(all, id)
		if len(sp) == 0 {
			return nil, fmt.Errorf("no Sentry process found for sandbox %s (is the runtime gVisor?)", id)
		}
		s, g := sumMem(sp), sumMem(gp)
		p := paths[set.path[id]]
		if p == nil {
			p = &byPath{}
			paths[set.path[id]] = p
		}
		p.pss = append(p.pss, mib(s.PSS+g.PSS))
		p.own = append(p.own, mib(s.PSSAnon))
		if c := cgroupMemory(sp[0]); c >= 0 {
			p.cg = append(p.cg, mib(c))
		}
		rss = append(rss, mib(s.RSS+g.RSS))
		sRSS = append(sRSS, mib(s.RSS))
		sPSS = append(sPSS, mib(s.PSS))
		sGuest = append(sGuest, mib(s.PSSShmem))
		gRSS = append(gRSS, mib(g.RSS))
		gPSS = append(gPSS, mib(g.PSS))
	}
	// The agent's own view last: the command that reads it adds a process for a moment.
	for _, id := range set.ids {
		var out strings.Builder
		code, err := cfg.Client.Exec(ctx, id, api.CreateSessionRequest{Argv: []string{"cat", "/proc/1/status"}}, client.Output{Stdout: &out})
		if err != nil || code != 0 {
			return nil, fmt.Errorf("read the agent's memory: exit %d: %v", code, err)
		}
		for _, l := range strings.Split(out.String(), "\n") {
			if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmRSS:" {
				kb, _ := strconv.Atoi(f[1])
				agent = append(agent, mib(kb))
			}
		}
	}

	base, err := bareIdle(ctx, cfg, min(cfg.Runs, 5), nil)
	if err != nil {
		return nil, fmt.Errorf("bare runsc: %w", err)
	}
	const bl = "bare runsc idle"
	var out []Result
	for _, path := range []string{"boot", "snapshot", "pool", ""} {
		p := paths[path]
		if p == nil {
			continue
		}
		name := map[string]string{"boot": "booted", "snapshot": "restored from the base snapshot", "pool": "from the pool", "": "start path unknown"}[path]
		out = append(out,
			result("density", "PSS per idle sandbox, "+name+": Sentry + gofer", "MiB", p.pss, bl, base.pss),
			result("density", "cgroup memory per idle sandbox, "+name, "MiB", p.cg, bl, base.cg),
			result("density", "Sentry own anonymous memory (PSS), "+name, "MiB", p.own, bl, base.sOwn),
		)
	}
	if len(out) > 0 {
		out[0].Note = fmt.Sprintf("%d idle sandboxes (%d fresh boots, then the default path), read %s after the last started; PSS splits shared pages (the runsc binary) among the processes mapping them; the cgroup holds the Sentry's and the gofer's memory, the guest's and kernel memory", len(set.ids), densityCount(cfg), settle)
	}
	n := float64(len(set.ids))
	out = append(out,
		result("density", "RSS per idle sandbox: Sentry + gofer", "MiB", rss, bl, base.rss),
		result("density", "Sentry PSS (with platform stubs)", "MiB", sPSS, bl, base.sPSS),
		result("density", "Sentry: guest memory (memory file, PSS)", "MiB", sGuest, bl, base.sGuest),
		result("density", "Sentry RSS", "MiB", sRSS, bl, base.sRSS),
		result("density", "gofer PSS", "MiB", gPSS, bl, base.gPSS),
		result("density", "gofer RSS", "MiB", gRSS, bl, base.gRSS),
		result("density", "agent RSS inside the sandbox", "MiB", agent, "", nil),
	)
	if srv > 0 {
		r := result("density", "space serve PSS growth per sandbox", "MiB", []float64{mib(srvAfter.PSS-srvBefore.PSS) / n}, "", nil)
		r.Note = fmt.Sprintf("space serve PSS %.1f MiB before, %.1f MiB with %d idle sandboxes", mib(srvBefore.PSS), mib(srvAfter.PSS), len(set.ids))
		out = append(out, r)
	}
	r := result("density", "host MemAvailable drop per sandbox", "MiB", []float64{mib(availBefore-availAfter) / n}, "", nil)
	r.Note = "the whole host's MemAvailable before and after creating them: includes kernel memory and page cache, and whatever else ran meanwhile"
	return append(out, r), nil
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(d):
		return nil
	}
}

// bareMem is the density breakdown of bare runsc containers.
type bareMem struct {
	rss, pss, sRSS, sPSS, sGuest, sOwn, gRSS, gPSS, cg []float64
}

// bareIdle starts n bare runsc containers of the template's root filesystem running
// `sleep`, with runsc's default flags plus flags, reads their memory after settling
// and removes them.
func bareIdle(ctx context.Context, cfg *Config, n int, flags []string) (bareMem, error) {
	var m bareMem
	rootfs, err := baseRootfs(ctx, cfg)
	if err != nil {
		return m, err
	}
	bundle, err := runscBundle(ctx, rootfs, []string{"sleep", "1000000"})
	if err != nil {
		return m, err
	}
	defer os.RemoveAll(bundle)
	root := filepath.Join(bundle, "state")
	defer gvisor.UnpinNullNetNS(root)
	var started []string
	defer func() {
		for _, id := range started {
			_ = exec.Command(gvisor.DefaultRunscPath, "--root", root, "delete", "-force", id).Run()
		}
	}()
	for i := 0; i < n; i++ {
		id := "benchidle" + ids.Secret(8)
		args := append([]string{"--root", root, "--network=none"}, flags...)
		args = append(args, "run", "-detach", "-bundle", bundle, id)
		// The detached sandbox keeps its stdio: a file, so that nothing waits on a pipe.
		logPath := filepath.Join(bundle, id+".log")
		logf, err := os.Create(logPath)
		if err != nil {
			return m, err
		}
		cmd := exec.CommandContext(ctx, gvisor.DefaultRunscPath, args...)
		cmd.Stdout, cmd.Stderr = logf, logf
		err = cmd.Run()
		logf.Close()
		if err != nil {
			out, _ := os.ReadFile(logPath)
			return m, fmt.Errorf("runsc run -detach: %v: %s", err, out)
		}
		started = append(started, id)
	}
	if err := sleepCtx(ctx, settle); err != nil {
		return m, err
	}
	all := listProcs()
	for _, id := range started {
		sp, gp := sandboxProcs(all, id)
		if len(sp) == 0 {
			return m, fmt.Errorf("no Sentry process for bare container %s", id)
		}
		s, g := sumMem(sp), sumMem(gp)
		m.rss = append(m.rss, mib(s.RSS+g.RSS))
		m.pss = append(m.pss, mib(s.PSS+g.PSS))
		m.sRSS = append(m.sRSS, mib(s.RSS))
		m.sPSS = append(m.sPSS, mib(s.PSS))
		m.sGuest = append(m.sGuest, mib(s.PSSShmem))
		m.sOwn = append(m.sOwn, mib(s.PSSAnon))
		m.gRSS = append(m.gRSS, mib(g.RSS))
		m.gPSS = append(m.gPSS, mib(g.PSS))
		if c := cgroupMemory(sp[0]); c >= 0 {
			m.cg = append(m.cg, mib(c))
		}
	}
	return m, nil
}
