package qemu

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/runtime"
	"github.com/spacedev/space/internal/runtime/instances"
	"github.com/spacedev/space/internal/template/templatetest"
	"github.com/spacedev/space/internal/testenv"
)

// procStatus returns the fields of /proc/PID/status.
func procStatus(t *testing.T, pid int) map[string]string {
	t.Helper()
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, line := range strings.Split(string(data), "\n") {
		if k, v, ok := strings.Cut(line, ":"); ok {
			out[k] = strings.TrimSpace(v)
		}
	}
	return out
}

// TestJail: a running QEMU is confined: its own unprivileged uid and gid, no capability
// in any set, no_new_privs, seccomp, a mount namespace holding only its binary,
// libraries, firmware, kernel, initramfs and a few devices (not the store, not its own
// or another sandbox's files), its own cgroup with the spec's limits; a QMP request that
// would spawn a process kills it. Destroy leaves no cgroup and no uid lease.
func TestJail(t *testing.T) {
	testenv.RequireRoot(t)
	rt, spec := needQEMU(t)
	store := templatetest.Store(t)
	ctx := context.Background()
	specs := []runtime.Spec{spec, spec}
	for i := range specs {
		specs[i].ID = fmt.Sprintf("jail%d%d", i, time.Now().UnixNano())
		specs[i].StateDir = t.TempDir()
		specs[i].RootFS = filepath.Join(store.Root(), specs[i].ID+".ext4")
		if err := os.WriteFile(specs[i].RootFS, []byte("secret of "+specs[i].ID), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(specs[i].RootFS, 64<<20); err != nil {
			t.Fatal(err)
		}
	}
	specs[0].PidsLimit = 100
	for _, s := range specs {
		if err := rt.Create(ctx, s); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { rt.Destroy(context.Background(), s.ID) })
		// Frozen before its kernel gets anywhere: the disk holds no file system.
		if err := rt.Pause(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
	}
	recs := make([]record, len(specs))
	for i, s := range specs {
		var err error
		if recs[i], err = rt.readRecord(s.ID); err != nil {
			t.Fatal(err)
		}
		if recs[i].PID == 0 || recs[i].PID != rt.instancePID(s.ID, &recs[i]) {
			t.Fatalf("%s: record pid %d is not its QEMU", s.ID, recs[i].PID)
		}
	}
	if recs[0].UID == recs[1].UID {
		t.Errorf("two VMs share uid %d", recs[0].UID)
	}
	vm, other := specs[0], specs[1]
	rec := recs[0]
	pid := rec.PID

	t.Run("credentials", func(t *testing.T) {
		st := procStatus(t, pid)
		uid := strconv.Itoa(rec.UID)
		if rec.UID < rt.cfg.FirstUID || rec.UID >= rt.cfg.FirstUID+rt.cfg.UIDCount {
			t.Errorf("uid %d outside the range %d+%d", rec.UID, rt.cfg.FirstUID, rt.cfg.UIDCount)
		}
		for _, k := range []string{"Uid", "Gid"} {
			if got := strings.Fields(st[k]); len(got) != 4 || slices.ContainsFunc(got, func(s string) bool { return s != uid }) {
				t.Errorf("%s: %q, want %s in all four", k, st[k], uid)
			}
		}
		if st["Groups"] != "" {
			t.Errorf("supplementary groups: %q", st["Groups"])
		}
		for _, k := range []string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
			if st[k] != "0000000000000000" {
				t.Errorf("%s: %s, want none", k, st[k])
			}
		}
		if st["NoNewPrivs"] != "1" {
			t.Errorf("NoNewPrivs: %q", st["NoNewPrivs"])
		}
		if st["Seccomp"] != "2" {
			t.Errorf("Seccomp: %q, want 2 (filter)", st["Seccomp"])
		}
		// QEMU's own process in its new PID namespace (the jail helper was its PID 1).
		if ns := strings.Fields(st["NSpid"]); len(ns) != 2 || ns[1] != "1" {
			t.Errorf("NSpid: %q, want its own PID namespace", st["NSpid"])
		}
	})

	t.Run("namespaces", func(t *testing.T) {
		for _, ns := range []string{"mnt", "pid", "net", "ipc", "uts"} {
			mine, _ := os.Readlink("/proc/self/ns/" + ns)
			its, err := os.Readlink(fmt.Sprintf("/proc/%d/ns/%s", pid, ns))
			if err != nil || its == mine {
				t.Errorf("%s namespace: %q (host %q) %v", ns, its, mine, err)
			}
		}
	})

	t.Run("filesystem view", func(t *testing.T) {
		root := fmt.Sprintf("/proc/%d/root", pid)
		for _, p := range []string{
			store.Root(), vm.RootFS, vm.StateDir, other.RootFS, other.StateDir, rt.cfg.RootDir,
			rt.cfg.LeaseDir, "/etc", "/home", "/root", "/var", "/run", "/tmp", "/boot", "/proc", "/sys",
			"/usr/bin/sh", "/usr/sbin", "/usr/local",
		} {
			if _, err := os.Lstat(filepath.Join(root, p)); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("%s is visible in the jail (%v)", p, err)
			}
		}
		entries, err := os.ReadDir(root)
		if err != nil {
			t.Fatal(err)
		}
		var names []string
		for _, e := range entries {
			names = append(names, e.Name())
		}
		for _, n := range names {
			if !slices.Contains([]string{"usr", "lib", "lib64", "dev", "vm"}, n) {
				t.Errorf("unexpected /%s in the jail's root (%v)", n, names)
			}
		}
		mounts, err := procfs.GetProcMounts(pid)
		if err != nil {
			t.Fatal(err)
		}
		allowed := []string{"/"}
		for _, b := range rt.jail.forVM(rt.cfg.KernelPath, "x", rec.UID, nil, nil).Binds {
			allowed = append(allowed, b.Dst)
		}
		for _, m := range mounts {
			if !slices.Contains(allowed, m.MountPoint) {
				t.Errorf("mount %s (%s from %s) in the jail", m.MountPoint, m.FSType, m.Root)
			}
			if _, ro := m.Options["ro"]; !ro {
				t.Errorf("mount %s is writable: %v", m.MountPoint, m.Options)
			}
			if _, nosuid := m.Options["nosuid"]; !nosuid {
				t.Errorf("mount %s allows setuid: %v", m.MountPoint, m.Options)
			}
		}
		if len(mounts) < 5 {
			t.Errorf("only %d mounts in the jail", len(mounts))
		}
		// Its open files: the disk (twice), the console log and the logs, sockets,
		// anonymous inodes, its devices: never another sandbox's file or a directory.
		fds, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, fd := range fds {
			target, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
			if strings.HasPrefix(target, other.StateDir) || target == other.RootFS {
				t.Errorf("fd %s is the other sandbox's %s", fd.Name(), target)
			}
			if fi, err := os.Stat(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name())); err == nil && fi.IsDir() {
				t.Errorf("fd %s is a directory (%s): a way out of the jail", fd.Name(), target)
			}
		}
	})

	t.Run("cgroup", func(t *testing.T) {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
		if err != nil {
			t.Fatal(err)
		}
		if len(rec.Cgroups) == 0 {
			t.Fatal("record has no cgroups")
		}
		for _, dir := range rec.Cgroups {
			procs, err := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
			if err != nil || !slices.Contains(strings.Fields(string(procs)), strconv.Itoa(pid)) {
				t.Errorf("QEMU %d is not in %s (%q, %v); its cgroups:\n%s", pid, dir, procs, err, data)
			}
		}
		want := map[string]string{
			"pids.max": "100",
		}
		memBytes := strconv.Itoa((vm.MemoryMB + memOverheadMB) << 20)
		if rt.cgroups.v2 {
			want["memory.max"] = memBytes
			want["cpu.max"] = fmt.Sprintf("%d %d", vm.CPU*cpuPeriod+cpuVMMShare, cpuPeriod)
		} else {
			want["memory.limit_in_bytes"] = memBytes
			want["cpu.cfs_quota_us"] = strconv.Itoa(vm.CPU*cpuPeriod + cpuVMMShare)
		}
		for file, v := range want {
			found := false
			for _, dir := range rec.Cgroups {
				got, err := os.ReadFile(filepath.Join(dir, file))
				if err != nil {
					continue
				}
				found = true
				if strings.TrimSpace(string(got)) != v {
					t.Errorf("%s: %q, want %q", filepath.Join(dir, file), got, v)
				}
			}
			if !found {
				t.Errorf("no cgroup of the VM has %s", file)
			}
		}
	})

	t.Run("spawn kills it", func(t *testing.T) {
		unlock, err := rt.lock(ctx, vm.ID)
		if err != nil {
			t.Fatal(err)
		}
		marker := filepath.Join(t.TempDir(), "spawned")
		qerr := rt.withQMP(ctx, vm.StateDir, func(q *qmp) error {
			return q.exec(ctx, "migrate", map[string]any{"uri": "exec:touch " + marker}, nil)
		})
		unlock()
		t.Logf("migrate exec: %v", qerr)
		deadline := time.Now().Add(30 * time.Second)
		for rt.instancePID(vm.ID, &rec) != 0 && time.Now().Before(deadline) {
			time.Sleep(20 * time.Millisecond)
		}
		if rt.instancePID(vm.ID, &rec) != 0 {
			t.Fatalf("QEMU still runs after a request to spawn a process (QMP: %v)", qerr)
		}
		if _, err := os.Stat(marker); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("the spawned command ran: %v", err)
		}
		if st, err := rt.Status(ctx, vm.ID); err != nil || st != runtime.StatusStopped {
			t.Errorf("Status after the kill: %v %v", st, err)
		}
		// The other VM is not affected.
		if st, err := rt.Status(ctx, other.ID); err != nil || st != runtime.StatusPaused {
			t.Errorf("other VM: %v %v", st, err)
		}
	})

	for i, s := range specs {
		if err := rt.Destroy(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		assertGone(t, rt, s)
		for _, dir := range recs[i].Cgroups {
			if _, err := os.Stat(dir); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("cgroup %s left: %v", dir, err)
			}
		}
		if _, err := os.Stat(rt.uids.path(recs[i].UID)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("uid lease %d left: %v", recs[i].UID, err)
		}
	}
}

// TestUIDLeases: uids are leased collision-free from the range, found again for the same
// holder, given back only by their holder, taken over when stale, and exhausted with a
// clear error.
func TestUIDLeases(t *testing.T) {
	const first = 0x7ff00000 // nothing runs as these
	dir := t.TempDir()
	u, err := newUIDLeases(filepath.Join(dir, "leases"), first, 4)
	if err != nil {
		t.Fatal(err)
	}
	rootDir := filepath.Join(dir, "root")
	recs := instances.Records[record]{Dir: filepath.Join(rootDir, recordsDir)}
	got := map[int]string{}
	for _, id := range []string{"a", "b", "c", "d"} {
		if err := recs.Claim(id, record{ID: id}); err != nil {
			t.Fatal(err)
		}
		uid, err := u.acquire(leaseHolder{RootDir: rootDir, ID: id}, func(uid int) error {
			return recs.Update(id, record{ID: id, UID: uid})
		})
		if err != nil {
			t.Fatal(err)
		}
		if uid < first || uid >= first+4 {
			t.Errorf("%s: uid %d outside the range", id, uid)
		}
		if prev, dup := got[uid]; dup {
			t.Errorf("uid %d leased to %s and %s", uid, prev, id)
		}
		got[uid] = id
	}
	if _, err := u.acquire(leaseHolder{RootDir: rootDir, ID: "e"}, func(int) error { return nil }); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("fifth lease from a range of 4: %v", err)
	}
	// A failed commit gives the lease back.
	var uidA int
	for uid, id := range got {
		if id == "a" {
			uidA = uid
		}
	}
	if err := u.release(uidA, leaseHolder{RootDir: rootDir, ID: "b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(u.path(uidA)); err != nil {
		t.Errorf("a lease was released by another holder: %v", err)
	}
	if err := u.release(uidA, leaseHolder{RootDir: rootDir, ID: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := u.acquire(leaseHolder{RootDir: rootDir, ID: "f"}, func(int) error { return errors.New("boom") }); err == nil {
		t.Error("acquire succeeded with a failing commit")
	}
	if _, err := os.Stat(u.path(uidA)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("failed commit kept its lease: %v", err)
	}
	// b's record is lost (a node died): its lease is stale and taken over.
	var uidB int
	for uid, id := range got {
		if id == "b" {
			uidB = uid
		}
	}
	if err := recs.Remove("b"); err != nil {
		t.Fatal(err)
	}
	taken := map[int]bool{}
	for _, id := range []string{"g", "h"} {
		uid, err := u.acquire(leaseHolder{RootDir: rootDir, ID: id}, func(uid int) error {
			return recs.Update(id, record{ID: id, UID: uid})
		})
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		taken[uid] = true
	}
	if !taken[uidA] || !taken[uidB] {
		t.Errorf("freed %d and stale %d not reused: %v", uidA, uidB, taken)
	}
	for _, bad := range [][2]int{{0, 10}, {1, 0}, {maxUID, 2}} {
		if _, err := newUIDLeases(dir, bad[0], bad[1]); err == nil {
			t.Errorf("range %d+%d accepted", bad[0], bad[1])
		}
	}
}

// TestBaseJail: the jail holds QEMU's binary, libraries and firmware; /dev/kvm only for
// KVM guests, with its group when it is not open to all.
func TestBaseJail(t *testing.T) {
	qemuPath, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		t.Skip("qemu-system-x86_64 not found")
	}
	js, err := baseJail(qemuPath, AccelTCG)
	if err != nil {
		t.Fatal(err)
	}
	dsts := map[string]jailBind{}
	for _, b := range js.Binds {
		dsts[b.Dst] = b
	}
	if b, ok := dsts[qemuPath]; !ok || !b.Exec {
		t.Errorf("QEMU's binary %s: %+v", qemuPath, b)
	}
	if b, ok := dsts["/usr/lib"]; !ok || !b.Exec || b.Dev {
		t.Errorf("/usr/lib: %+v", b)
	}
	if b, ok := dsts["/dev/null"]; !ok || !b.Dev || b.Exec {
		t.Errorf("/dev/null: %+v", b)
	}
	if _, ok := dsts["/dev/kvm"]; ok || len(js.Groups) != 0 {
		t.Errorf("a TCG jail has /dev/kvm or groups %v", js.Groups)
	}
	for _, b := range js.Binds {
		if !b.Dev && strings.HasPrefix(b.Dst, "/dev") {
			t.Errorf("%s without dev", b.Dst)
		}
	}
	var st unix.Stat_t
	if unix.Stat("/dev/kvm", &st) != nil {
		return
	}
	js, err = baseJail(qemuPath, AccelKVM)
	if st.Mode&0o006 != 0o006 && (st.Mode&0o060 != 0o060 || st.Gid == 0) {
		if err == nil {
			t.Errorf("/dev/kvm mode %o gid %d: accepted", st.Mode&0o777, st.Gid)
		}
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if b := slices.IndexFunc(js.Binds, func(b jailBind) bool { return b.Dst == "/dev/kvm" && b.Dev }); b < 0 {
		t.Error("no /dev/kvm for KVM")
	}
	if st.Mode&0o006 != 0o006 && !slices.Equal(js.Groups, []int{int(st.Gid)}) {
		t.Errorf("groups %v, want /dev/kvm's %d", js.Groups, st.Gid)
	}
}

// TestBadPidsLimit: a pids limit QEMU cannot run under is refused before anything is made.
func TestBadPidsLimit(t *testing.T) {
	rt, spec := needQEMU(t)
	for _, n := range []int{-1, 1, minPids(spec.CPU) - 1} {
		spec.PidsLimit = n
		if err := rt.Create(context.Background(), spec); err == nil || !strings.Contains(err.Error(), "pids") {
			t.Errorf("pids limit %d: %v", n, err)
		}
		assertGone(t, rt, spec)
	}
}
