package bench

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/prometheus/procfs"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/cgroupstat"
	"github.com/spacedev/space/internal/runtime/qemu"
)

// scaleSteps are the counts of idle sandboxes the scale scenario measures at.
var scaleSteps = []int{10, 50, 100, 200}

// scaleMemoryMB is the memory limit of the scale scenario's idle sandboxes: an idle
// sandbox uses a few tens of MiB whatever its limit, and the node places sandboxes by
// their limits (a default-sized 512 MiB sandbox would stop the count at the node's
// memory capacity long before 200 on a small host). They boot (fresh_boot), so that
// every step measures the same start path.
const scaleMemoryMB = 128

// scaleDiskMB is their disk limit: an idle sandbox writes nothing, and a tenant's disk
// quota charges each sandbox its limit (200 sandboxes of the default 10 GiB would be
// 2 TiB, twice the default tenant quota: the count stopped at 102).
const scaleDiskMB = 1024

// scaleSettle is how long a step's sandboxes are left idle before memory is read.
const scaleSettle = 3 * time.Second

// scaleCPUWindow is how long each step's idle CPU is read unless Config.ScaleCPUWindow
// says: four of a node's 5 s resource-sample rounds.
const scaleCPUWindow = 20 * time.Second

// scale creates idle sandboxes (scaleMemoryMB, scaleDiskMB) on the server in steps of 10, 50, 100 and 200 (those
// below cfg.ScaleMax, then cfg.ScaleMax) and at each step reports how fast they were created, the API's latency
// while they exist (GET of a sandbox, the list, a `true` command; the baseline is the
// same request before any was created), and the host memory per sandbox.
func scale(ctx context.Context, cfg *Config) ([]Result, error) {
	maxN := cfg.ScaleMax
	if maxN <= 0 {
		maxN = scaleSteps[len(scaleSteps)-1]
	}
	set := &idleSet{cfg: cfg}
	defer set.deleteAll(ctx)
	samples := max(cfg.Runs, 20)
	window := cfg.ScaleCPUWindow
	if window <= 0 {
		window = scaleCPUWindow
	}

	// One sandbox the latency probes use throughout (GET and exec), and the empty
	// server's latencies as the baseline.
	probe, done, err := sandbox(ctx, cfg, api.CreateSandboxRequest{})
	if err != nil {
		return nil, err
	}
	defer done()
	get0, list0, exec0, err := apiLatency(ctx, cfg, probe.ID, nil, samples)
	if err != nil {
		return nil, err
	}
	availStart := memAvailable()
	// The host's busy CPU with no idle sandboxes, against which each step's is read.
	busy0 := hostBusy()
	if err := sleepCtx(ctx, window); err != nil {
		return nil, err
	}
	idleRate := msPerS(hostBusy()-busy0, window)
	var out []Result
	var steps []int
	for _, n := range scaleSteps {
		if n < maxN {
			steps = append(steps, n)
		}
	}
	for _, n := range append(steps, maxN) {
		k := n - len(set.ids)
		start := time.Now()
		lat, err := set.grow(ctx, n, "scale", api.CreateSandboxRequest{FreshBoot: true, MemoryMB: scaleMemoryMB, DiskMB: scaleDiskMB})
		if err != nil {
			if strings.Contains(err.Error(), "quota_exceeded") {
				err = fmt.Errorf("%w (raise the tenant's quota the error names for the run, e.g. `space tenant set-quota default --running %d` or `--disk-mb unlimited`, or lower --scale-max)", err, maxN+10)
			}
			return out, err
		}
		took := time.Since(start)
		if err := sleepCtx(ctx, scaleSettle); err != nil {
			return out, err
		}
		avail := memAvailable()
		all := listProcs()
		var cg, pss []float64
		pssName := "PSS per sandbox: Sentry + gofer"
		for _, id := range set.ids {
			sp, gp := sandboxProcs(all, id)
			if len(sp) == 0 {
				// A QEMU node's VM: one process.
				if pid := qemu.FindVMProcess(id); pid > 0 {
					sp, pssName = []int{pid}, "PSS per sandbox: QEMU"
				} else {
					continue
				}
			}
			pss = append(pss, mib(sumMem(sp).PSS+sumMem(gp).PSS))
			if c := cgroupMemory(sp[0]); c >= 0 {
				cg = append(cg, mib(c))
			}
		}
		perSandbox, hostRate, err := idleCPU(ctx, all, set.ids, window)
		if err != nil {
			return out, err
		}
		get, list, ex, err := apiLatency(ctx, cfg, probe.ID, set.ids, samples)
		if err != nil {
			return out, err
		}
		p := func(metric string) string { return fmt.Sprintf("%d idle: %s", n, metric) }
		tp := result("scale", p("create throughput"), "sandboxes/s", []float64{float64(k) / took.Seconds()}, "", nil)
		tp.Note = fmt.Sprintf("%d sandboxes created 4 at a time in %s", k, took.Round(time.Millisecond))
		host := result("scale", p("host MemAvailable drop per sandbox"), "MiB", []float64{mib(availStart-avail) / float64(n)}, "", nil)
		host.Note = "the whole host's MemAvailable (kernel, page cache and the server included; other work on the host too)"
		out = append(out, tp,
			result("scale", p("create → running"), "ms", lat, "", nil),
			withP99(result("scale", p("GET /v1/sandboxes/{id}"), "ms", get, "no idle sandboxes", get0)),
			withP99(result("scale", p("GET /v1/sandboxes (list)"), "ms", list, "no idle sandboxes", list0)),
			withP99(result("scale", p("exec `true`"), "ms", ex, "no idle sandboxes", exec0)),
			result("scale", p(pssName), "MiB", pss, "", nil),
		)
		if len(cg) > 0 {
			out = append(out, result("scale", p("sandbox cgroup memory"), "MiB", cg, "", nil))
		}
		out = append(out, host)
		if len(perSandbox) > 0 {
			r := result("scale", p("CPU per idle sandbox (its cgroup)"), "ms/s", perSandbox, "", nil)
			r.Note = fmt.Sprintf("each sandbox's host cgroup CPU over %s (the Sentry, its stubs and the gofer; a VM's QEMU)", window)
			out = append(out, r)
		}
		hr := result("scale", p("host CPU per idle sandbox"), "ms/s", []float64{(hostRate - idleRate) / float64(n)}, "", nil)
		hr.Note = fmt.Sprintf("the whole host's busy CPU over %s, less the same with no idle sandboxes (%.1f ms/s), per sandbox: the server and PostgreSQL included, other work on the host too", window, idleRate)
		out = append(out, hr)
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "bench: scale: %d idle sandboxes (%s)\n", n, took.Round(time.Millisecond))
		}
	}
	return out, nil
}

// withP99 adds the 99th percentile of the samples to the row's note.
func withP99(r Result) Result {
	p99 := func(xs []float64) float64 {
		if len(xs) == 0 {
			return 0
		}
		s := slices.Clone(xs)
		sort.Float64s(s)
		rank := int(0.99*float64(len(s))+0.999999) - 1
		return s[max(0, min(rank, len(s)-1))]
	}
	r.Note = fmt.Sprintf("p99 %s", num(p99(r.Samples), r.Unit))
	if r.Baseline != "" {
		r.Note += fmt.Sprintf(" (%s: p99 %s)", r.Baseline, num(p99(r.BaselineSamples), r.Unit))
	}
	return r
}

// apiLatency times n GETs of sandboxes (the probe, then idle ones in turn), n lists of
// every sandbox and n `true` commands in the probe.
func apiLatency(ctx context.Context, cfg *Config, probe string, idle []string, n int) (get, list, ex []float64, err error) {
	c := cfg.Client
	for i := 0; i < n; i++ {
		id := probe
		if len(idle) > 0 && i%2 == 1 {
			id = idle[i%len(idle)]
		}
		start := time.Now()
		if _, err := c.GetSandbox(ctx, id); err != nil {
			return nil, nil, nil, err
		}
		get = append(get, ms(time.Since(start)))
		start = time.Now()
		if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
			return nil, nil, nil, err
		}
		list = append(list, ms(time.Since(start)))
		start = time.Now()
		code, err := c.Exec(ctx, probe, api.CreateSessionRequest{Argv: []string{"true"}}, client.Output{})
		if err != nil || code != 0 {
			return nil, nil, nil, fmt.Errorf("true: exit %d: %v", code, err)
		}
		ex = append(ex, ms(time.Since(start)))
	}
	return get, list, ex, nil
}

// idleCPU reads, over window, each sandbox's cgroup CPU (ms of CPU per second) and the
// whole host's busy CPU (ms/s).
func idleCPU(ctx context.Context, all []proc, ids []string, window time.Duration) (perSandbox []float64, host float64, err error) {
	var pids []int
	for _, id := range ids {
		if sp, _ := sandboxProcs(all, id); len(sp) > 0 {
			pids = append(pids, sp[0])
		} else if pid := qemu.FindVMProcess(id); pid > 0 {
			pids = append(pids, pid)
		}
	}
	before := make([]time.Duration, len(pids))
	for i, pid := range pids {
		before[i], _ = cgroupstat.CPU(pid)
	}
	busy := hostBusy()
	if err := sleepCtx(ctx, window); err != nil {
		return nil, 0, err
	}
	host = msPerS(hostBusy()-busy, window)
	for i, pid := range pids {
		if after, err := cgroupstat.CPU(pid); err == nil && before[i] > 0 && after >= before[i] {
			perSandbox = append(perSandbox, msPerS(after-before[i], window))
		}
	}
	return perSandbox, host, nil
}

// hostBusy is the CPU time the host has spent busy on all its CPUs (/proc/stat: user,
// nice, system, irq, softirq, steal).
func hostBusy() time.Duration {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return 0
	}
	st, err := fs.Stat()
	if err != nil {
		return 0
	}
	c := st.CPUTotal
	return time.Duration((c.User + c.Nice + c.System + c.IRQ + c.SoftIRQ + c.Steal) * float64(time.Second))
}

// msPerS is CPU time used over a wall time, in milliseconds per second.
func msPerS(used, over time.Duration) float64 {
	return float64(used) / float64(time.Millisecond) / over.Seconds()
}
