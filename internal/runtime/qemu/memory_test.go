package qemu

import (
	"cmp"
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// memoryVariant is one combination of the memory settings TestIdleMemory compares.
type memoryVariant struct {
	name    string
	balloon bool
	host    hostOpts
	cmdline string // added to the guest kernel's command line
	kernel  string // the kernel QEMU boots; default the configured one, through the firmware
}

// TestIdleMemory boots idle VMs of the base template with each memory setting alone
// and with the runtime's defaults, interleaved in one run, and logs where each VM's
// host memory goes (ReadVMMemory) against the guest's own view of what it uses. It
// measures, it asserts only that the breakdown finds the guest's RAM: run it with
// SPACE_QEMU_MEMORY=1 (SPACE_QEMU_MEMORY_VMS VMs per variant, default 2;
// SPACE_QEMU_MEMORY_MB the guest size, default 512):
//
//	SPACE_QEMU_MEMORY=1 go test -p 1 -run TestIdleMemory -v ./internal/runtime/qemu/
func TestIdleMemory(t *testing.T) {
	if os.Getenv("SPACE_QEMU_MEMORY") == "" {
		t.Skip("set SPACE_QEMU_MEMORY=1 to measure")
	}
	rt, _ := needQEMU(t)
	n, err := strconv.Atoi(os.Getenv("SPACE_QEMU_MEMORY_VMS"))
	if err != nil || n < 1 {
		n = 2
	}
	guestMB, _ := strconv.Atoi(os.Getenv("SPACE_QEMU_MEMORY_MB"))
	if guestMB <= 0 {
		guestMB = 512
	}
	store := templatetest.Store(t)
	rel := templatetest.Base(t, store)
	_, agent := testenv.Binaries(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	old := hostOpts{TCGCacheMB: 32, THP: true}
	variants := []memoryVariant{
		{name: "before: tb-size=32, THP, no balloon", host: old},
		{name: "THP off", host: hostOpts{TCGCacheMB: 32}},
		{name: "balloon, free page reporting", balloon: true, host: old},
		{name: "balloon, reporting order 0", balloon: true, host: old, cmdline: "page_reporting.page_reporting_order=0"},
		{name: "balloon, THP off", balloon: true, host: hostOpts{TCGCacheMB: 32}},
		{name: "tb-size=16", host: hostOpts{TCGCacheMB: 16, THP: true}},
		{name: "tb-size=8", host: hostOpts{TCGCacheMB: 8, THP: true}},
		{name: "defaults (Create)", balloon: true, host: rt.host, kernel: rt.boot},
		{name: "defaults, firmware boot of the bzImage (before PVH)", balloon: true, host: rt.host},
	}
	if v := os.Getenv("SPACE_QEMU_MEMORY_ONLY"); v != "" {
		// A comma-separated list of variant indexes.
		var keep []memoryVariant
		for _, f := range strings.Split(v, ",") {
			if i, err := strconv.Atoi(f); err == nil && i >= 0 && i < len(variants) {
				keep = append(keep, variants[i])
			}
		}
		variants = keep
	}
	initrd, cmdline := bootFiles(t, ctx, rt, agent)
	type vm struct {
		v    int
		spec runtime.Spec
		boot time.Duration
	}
	var vms []vm
	var mu sync.Mutex
	defer func() {
		for _, x := range vms {
			_ = rt.Destroy(context.Background(), x.spec.ID)
		}
	}()
	// Two at a time, the variants interleaved: every variant boots under the same load.
	sem := make(chan struct{}, 2)
	errs := make(chan error, n*len(variants))
	var wg sync.WaitGroup
	for round := range n {
		for i, v := range variants {
			id := fmt.Sprintf("mem%d%d%d", round, i, time.Now().UnixNano()%1e9)
			disk, err := store.CreateSandboxDisk(ctx, id, rel.Digest, 0)
			if err != nil {
				t.Fatal(err)
			}
			spec, err := rt.checkSpec(runtime.Spec{ID: id, RootFS: disk, StateDir: t.TempDir(), AgentPath: agent, CPU: 1, MemoryMB: guestMB})
			if err != nil {
				t.Fatal(err)
			}
			mu.Lock()
			vms = append(vms, vm{v: i, spec: spec})
			k := len(vms) - 1
			mu.Unlock()
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				m := machine{
					MemoryMB: guestMB, CPU: 1, Accel: rt.accel, Kernel: cmp.Or(v.kernel, rt.cfg.KernelPath), Initrd: initrd,
					Append: strings.TrimSpace(v.cmdline + " " + cmdline), QEMU: rt.version, Balloon: v.balloon, Host: v.host,
				}
				start := time.Now()
				if err := rt.launch(ctx, spec, m, ""); err != nil {
					errs <- fmt.Errorf("%s: %w", v.name, err)
					return
				}
				c := agentclient.New(func(ctx context.Context) (net.Conn, error) { return rt.Dial(ctx, id) })
				rctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
				defer cancel()
				if _, err := c.WaitReady(rctx); err != nil {
					errs <- fmt.Errorf("%s: agent not ready: %w", v.name, err)
				}
				mu.Lock()
				vms[k].boot = time.Since(start)
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	// Free page reporting reports a couple of seconds after pages are freed; the
	// guest's start-up work is done well before this.
	time.Sleep(30 * time.Second)
	type row struct{ rss, pss, guest, thp, tcg, anon, file, filePSS, used, boot []float64 }
	rows := make([]row, len(variants))
	mib := func(kb int) float64 { return float64(kb) / 1024 }
	for _, x := range vms {
		pid := rt.instancePID(x.spec.ID, nil)
		m, err := ReadVMMemory(pid, guestMB)
		if err != nil {
			t.Fatal(err)
		}
		c := agentclient.New(func(ctx context.Context) (net.Conn, error) { return rt.Dial(ctx, x.spec.ID) })
		used, err := guestUsed(ctx, c)
		if err != nil {
			t.Fatal(err)
		}
		r := &rows[x.v]
		r.rss = append(r.rss, mib(m.RSS))
		r.pss = append(r.pss, mib(m.PSS))
		r.guest = append(r.guest, mib(m.GuestRSS))
		r.thp = append(r.thp, mib(m.GuestTHP))
		r.tcg = append(r.tcg, mib(m.TCGRSS))
		r.anon = append(r.anon, mib(m.OwnAnonRSS))
		r.file = append(r.file, mib(m.OwnFileRSS))
		r.filePSS = append(r.filePSS, mib(m.OwnFilePSS))
		r.used = append(r.used, mib(used))
		r.boot = append(r.boot, x.boot.Seconds())
	}
	med := func(xs []float64) float64 {
		s := slices.Clone(xs)
		slices.Sort(s)
		if len(s) == 0 {
			return 0
		}
		if len(s)%2 == 1 {
			return s[len(s)/2]
		}
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d VMs per variant, %d MiB guests, medians (MiB)\n", n, guestMB)
	b.WriteString("| variant | QEMU RSS | QEMU PSS | guest RAM resident (of it THP) | TCG cache | QEMU own anon | QEMU files RSS / PSS | guest used (MemTotal − MemFree) | RSS − guest RAM | PSS − guest RAM | boot (s) |\n|---|---|---|---|---|---|---|---|---|---|---|\n")
	for i, v := range variants {
		r := rows[i]
		fmt.Fprintf(&b, "| %s | %.1f | %.1f | %.1f (%.0f) | %.1f | %.1f | %.1f / %.1f | %.1f | %.1f | %.1f | %.1f |\n", v.name,
			med(r.rss), med(r.pss), med(r.guest), med(r.thp), med(r.tcg), med(r.anon), med(r.file), med(r.filePSS), med(r.used),
			med(r.rss)-med(r.guest), med(r.pss)-med(r.guest), med(r.boot))
	}
	t.Log("\n" + b.String())
	if len(vms) > 0 {
		t.Log("largest anonymous mappings of QEMU itself (KiB resident), first VM:\n" + anonMappings(rt.instancePID(vms[0].spec.ID, nil), guestMB))
	}
	if os.Getenv("SPACE_QEMU_MEMORY_KSM") != "" {
		var specs []runtime.Spec
		for _, x := range vms {
			specs = append(specs, x.spec)
		}
		ksmPhase(t, rt, specs, guestMB)
	}
}

// bootFiles builds the initramfs for agent and the kernel command line a VM launched
// directly (rt.launch) boots with.
func bootFiles(t *testing.T, ctx context.Context, rt *Runtime, agent string) (initrd, cmdline string) {
	t.Helper()
	initrd, err := rt.initrds.Build(ctx, agent)
	if err != nil {
		t.Fatal(err)
	}
	if err := ensureWorldReadable(initrd); err != nil {
		t.Fatal(err)
	}
	if cmdline, err = kernelCmdline(nil, rt.tscKHz); err != nil {
		t.Fatal(err)
	}
	return initrd, cmdline
}

// anonMappings lists pid's ten largest resident anonymous mappings other than the
// guest's RAM.
func anonMappings(pid, guestMB int) string {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return err.Error()
	}
	type m struct {
		hdr       string
		size, rss int
	}
	var ms []m
	for _, l := range strings.Split(string(data), "\n") {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		if !strings.HasSuffix(f[0], ":") {
			if len(f) == 5 || (len(f) > 5 && strings.HasPrefix(f[5], "[")) {
				ms = append(ms, m{hdr: l})
			} else {
				ms = append(ms, m{hdr: ""})
			}
			continue
		}
		if len(ms) == 0 || len(f) < 2 {
			continue
		}
		kb, _ := strconv.Atoi(f[1])
		switch f[0] {
		case "Size:":
			ms[len(ms)-1].size = kb
		case "Rss:":
			ms[len(ms)-1].rss = kb
		}
	}
	ms = slices.DeleteFunc(ms, func(x m) bool { return x.hdr == "" || x.size >= guestMB<<10 })
	slices.SortFunc(ms, func(a, b m) int { return b.rss - a.rss })
	var b strings.Builder
	for i, x := range ms {
		if i == 10 {
			break
		}
		fmt.Fprintf(&b, "%8d of %8d  %s\n", x.rss, x.size, x.hdr)
	}
	return b.String()
}

// ksmPhase turns the host's KSM on for a minute (QEMU marks guest RAM mergeable by
// default), logs the VMs' PSS before and after and what KSM reports, and puts the
// host's KSM settings back (unmerging).
func ksmPhase(t *testing.T, rt *Runtime, specs []runtime.Spec, guestMB int) {
	const ksm = "/sys/kernel/mm/ksm/"
	read := func(name string) string {
		b, _ := os.ReadFile(ksm + name)
		return strings.TrimSpace(string(b))
	}
	write := func(name, v string) {
		if err := os.WriteFile(ksm+name, []byte(v), 0o644); err != nil {
			t.Logf("ksm %s: %v", name, err)
		}
	}
	if read("run") == "" {
		t.Log("no KSM on this host")
		return
	}
	pss := func() float64 {
		var sum int
		for _, s := range specs {
			m, _ := ReadVMMemory(rt.instancePID(s.ID, nil), guestMB)
			sum += m.PSS
		}
		return float64(sum) / 1024 / float64(len(specs))
	}
	run, scan, sleep := read("run"), read("pages_to_scan"), read("sleep_millisecs")
	defer func() {
		write("run", "2") // unmerge
		write("pages_to_scan", scan)
		write("sleep_millisecs", sleep)
		write("run", run)
	}()
	before := pss()
	write("pages_to_scan", "1000")
	write("sleep_millisecs", "20")
	write("run", "1")
	time.Sleep(90 * time.Second)
	t.Logf("KSM 90 s: PSS per VM %.1f → %.1f MiB; pages_sharing %s pages_shared %s full_scans %s general_profit %s",
		before, pss(), read("pages_sharing"), read("pages_shared"), read("full_scans"), read("general_profit"))
}

// guestUsed reads the guest's MemTotal − MemFree (KiB): what its kernel holds, page
// cache included.
func guestUsed(ctx context.Context, c *agentclient.Client) (int, error) {
	x, err := c.Exec(ctx, wire.ProcessSpec{Argv: []string{"cat", "/proc/meminfo"}}, nil)
	if err != nil {
		return 0, err
	}
	defer x.Out.Close()
	var data strings.Builder
	for done := false; !done; {
		f, err := x.Out.Next()
		if err != nil {
			return 0, err
		}
		switch f.Type {
		case wire.FrameStdout:
			data.Write(f.Payload)
		case wire.FrameExit:
			done = true
		}
	}
	return GuestUsedKB(data.String())
}

func TestGuestUsedKB(t *testing.T) {
	kb, err := GuestUsedKB("MemTotal:        1000 kB\nMemFree:          300 kB\nMemAvailable:     700 kB\n")
	if err != nil || kb != 700 {
		t.Fatalf("GuestUsedKB = %d, %v; want 700", kb, err)
	}
	if _, err := GuestUsedKB("MemFree: 3 kB\n"); err == nil {
		t.Fatal("no MemTotal: no error")
	}
}
