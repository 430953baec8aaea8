package qemu

import (
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
	n, _ := strconv.Atoi(os.Getenv("SPACE_QEMU_MEMORY_VMS"))
	n = max(n, 1)
	if os.Getenv("SPACE_QEMU_MEMORY_VMS") == "" {
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
		{name: "tb-size=16", host: hostOpts{TCGCacheMB: 16, THP: true}},
		{name: "tb-size=8", host: hostOpts{TCGCacheMB: 8, THP: true}},
		{name: "MALLOC_ARENA_MAX=1", host: hostOpts{TCGCacheMB: 32, THP: true, MallocArenas: 1}},
		{name: "defaults (Create)", balloon: true, host: rt.host},
	}
	initrd, err := rt.initrds.Build(ctx, agent)
	if err != nil {
		t.Fatal(err)
	}
	if err := ensureWorldReadable(initrd); err != nil {
		t.Fatal(err)
	}
	cmdline, err := kernelCmdline(nil, rt.tscKHz)
	if err != nil {
		t.Fatal(err)
	}
	type vm struct {
		v    int
		spec runtime.Spec
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
			spec := runtime.Spec{ID: id, RootFS: disk, StateDir: t.TempDir(), AgentPath: agent, CPU: 1, MemoryMB: guestMB}
			mu.Lock()
			vms = append(vms, vm{v: i, spec: spec})
			mu.Unlock()
			wg.Add(1)
			sem <- struct{}{}
			go func() {
				defer wg.Done()
				defer func() { <-sem }()
				m := machine{
					MemoryMB: guestMB, CPU: 1, Accel: rt.accel, Kernel: rt.cfg.KernelPath, Initrd: initrd,
					Append: cmdline, QEMU: rt.version, Balloon: v.balloon, Host: v.host,
				}
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
	type row struct{ rss, pss, guest, thp, tcg, anon, file, filePSS, used []float64 }
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
	b.WriteString("| variant | QEMU RSS | QEMU PSS | guest RAM resident (of it THP) | TCG cache | QEMU own anon | QEMU files RSS / PSS | guest used (MemTotal − MemFree) | RSS − guest RAM |\n|---|---|---|---|---|---|---|---|---|\n")
	for i, v := range variants {
		r := rows[i]
		fmt.Fprintf(&b, "| %s | %.1f | %.1f | %.1f (%.0f) | %.1f | %.1f | %.1f / %.1f | %.1f | %.1f |\n", v.name,
			med(r.rss), med(r.pss), med(r.guest), med(r.thp), med(r.tcg), med(r.anon), med(r.file), med(r.filePSS), med(r.used), med(r.rss)-med(r.guest))
	}
	t.Log("\n" + b.String())
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
	var total, free int
	for _, l := range strings.Split(data.String(), "\n") {
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.Atoi(f[1])
		switch f[0] {
		case "MemTotal:":
			total = kb
		case "MemFree:":
			free = kb
		}
	}
	if total == 0 {
		return 0, fmt.Errorf("no MemTotal in the guest's /proc/meminfo")
	}
	return total - free, nil
}
