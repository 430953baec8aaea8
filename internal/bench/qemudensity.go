package bench

import (
	"context"
	"fmt"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/runtime/qemu"
)

// qemuDensity is the density breakdown of a QEMU node's idle VMs. Per VM: the QEMU
// process (RSS and PSS, per start path), split by qemu.ReadVMMemory into the guest's
// RAM resident on the host (what the guest touched and the host still holds), TCG's
// code cache and QEMU's own memory (heap, stacks; its binary and libraries, shared);
// the VM's cgroup; what the guest's kernel counts as used (MemTotal − MemFree); and the
// host memory beyond the guest's resident RAM, which the issue bounds (touched guest
// memory + 40 MiB).
func qemuDensity(ctx context.Context, cfg *Config, set *idleSet, srvBefore, srvAfter procMem, availDrop int) ([]Result, error) {
	type byPath struct{ rss, pss, cg, over []float64 }
	paths := map[string]*byPath{}
	var guest, thp, tcg, own, files, filesPSS, used, overUsed []float64
	rssByID := map[string]int{}
	for _, id := range set.ids {
		pid := qemu.FindVMProcess(id)
		if pid == 0 {
			return nil, fmt.Errorf("no QEMU process found for sandbox %s", id)
		}
		m, err := qemu.ReadVMMemory(pid, set.sb[id].MemoryMB)
		if err != nil {
			return nil, err
		}
		p := paths[set.path[id]]
		if p == nil {
			p = &byPath{}
			paths[set.path[id]] = p
		}
		p.rss = append(p.rss, mib(m.RSS))
		p.pss = append(p.pss, mib(m.PSS))
		p.over = append(p.over, mib(m.RSS-m.GuestRSS))
		if c := cgroupMemory(pid); c >= 0 {
			p.cg = append(p.cg, mib(c))
		}
		rssByID[id] = m.RSS
		guest = append(guest, mib(m.GuestRSS))
		thp = append(thp, mib(m.GuestTHP))
		tcg = append(tcg, mib(m.TCGRSS))
		own = append(own, mib(m.OwnAnonRSS))
		files = append(files, mib(m.OwnFileRSS))
		filesPSS = append(filesPSS, mib(m.OwnFilePSS))
	}
	// The guest's own view last: the command that reads it touches a little memory.
	for _, id := range set.ids {
		kb, err := guestUsedKB(ctx, cfg.Client, id)
		if err != nil {
			return nil, err
		}
		used = append(used, mib(kb))
		overUsed = append(overUsed, mib(rssByID[id]-kb))
	}
	var out []Result
	for _, path := range []string{"boot", "snapshot", "pool", ""} {
		p := paths[path]
		if p == nil {
			continue
		}
		name := map[string]string{"boot": "booted", "snapshot": "restored from the base snapshot", "pool": "from the pool", "": "start path unknown"}[path]
		out = append(out,
			result("density", "QEMU RSS per idle VM, "+name, "MiB", p.rss, "", nil),
			result("density", "QEMU PSS per idle VM, "+name, "MiB", p.pss, "", nil),
			result("density", "cgroup memory per idle VM, "+name, "MiB", p.cg, "", nil),
			result("density", "host memory beyond the guest's resident RAM (RSS − guest RAM), "+name, "MiB", p.over, "", nil),
		)
	}
	if len(out) > 0 {
		out[0].Note = fmt.Sprintf("%d idle QEMU VMs (%d fresh boots, then the default path), read %s after the last started", len(set.ids), densityCount(cfg), settle)
	}
	n := float64(len(set.ids))
	out = append(out,
		result("density", "guest RAM resident on the host", "MiB", guest, "", nil),
		result("density", "guest RAM resident: transparent huge pages", "MiB", thp, "", nil),
		result("density", "guest's own use (MemTotal − MemFree, page cache included)", "MiB", used, "", nil),
		result("density", "QEMU RSS − guest's own use", "MiB", overUsed, "", nil),
		result("density", "TCG code cache, resident", "MiB", tcg, "", nil),
		result("density", "QEMU own anonymous memory (heap, stacks, buffers)", "MiB", own, "", nil),
		result("density", "QEMU binary and libraries, RSS", "MiB", files, "", nil),
		result("density", "QEMU binary and libraries, PSS", "MiB", filesPSS, "", nil),
	)
	if srvAfter.PSS > 0 {
		r := result("density", "space serve PSS growth per sandbox", "MiB", []float64{mib(srvAfter.PSS-srvBefore.PSS) / n}, "", nil)
		r.Note = fmt.Sprintf("space serve PSS %.1f MiB before, %.1f MiB with %d idle sandboxes", mib(srvBefore.PSS), mib(srvAfter.PSS), len(set.ids))
		out = append(out, r)
	}
	r := result("density", "host MemAvailable drop per sandbox", "MiB", []float64{mib(availDrop) / n}, "", nil)
	r.Note = "the whole host's MemAvailable before and after creating them: includes kernel memory and page cache, and whatever else ran meanwhile"
	return append(out, r), nil
}

// guestUsedKB reads MemTotal − MemFree of the sandbox's kernel (KiB).
func guestUsedKB(ctx context.Context, c *client.Client, id string) (int, error) {
	var out strings.Builder
	code, err := c.Exec(ctx, id, api.CreateSessionRequest{Argv: []string{"cat", "/proc/meminfo"}}, client.Output{Stdout: &out})
	if err != nil || code != 0 {
		return 0, fmt.Errorf("read the guest's meminfo: exit %d: %v", code, err)
	}
	kb, err := qemu.GuestUsedKB(out.String())
	if err != nil {
		return 0, fmt.Errorf("sandbox %s: %w", id, err)
	}
	return kb, nil
}
