package qemu

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
)

// VMMemory is where a QEMU process's memory goes (KiB), from /proc/PID/smaps: the
// guest's RAM (the one anonymous mapping of the guest's size), TCG's translated-code
// cache (anonymous and executable), and QEMU itself (its heap, thread stacks, the
// libraries and binary it maps). RSS counts every resident page once per process; PSS
// splits pages shared with other processes (QEMU's and the libraries' text) among them.
type VMMemory struct {
	RSS, PSS int
	// GuestRSS is the guest's RAM that is resident on the host: every page the guest
	// touched and the host still holds. GuestTHP is how much of it is transparent huge
	// pages.
	GuestRSS, GuestTHP int
	// TCGRSS is TCG's code cache that is resident (0 under KVM).
	TCGRSS int
	// OwnAnonRSS is QEMU's own anonymous memory (heap, stacks, device buffers);
	// OwnFileRSS and OwnFilePSS the files it maps (its binary and libraries).
	OwnAnonRSS, OwnFileRSS, OwnFilePSS int
}

// ReadVMMemory breaks down the memory of QEMU process pid whose guest has guestMB MiB.
func ReadVMMemory(pid, guestMB int) (VMMemory, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/smaps", pid))
	if err != nil {
		return VMMemory{}, err
	}
	defer f.Close()
	type vma struct {
		anon, exec          bool
		size, rss, pss, thp int
	}
	var vmas []vma
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if !strings.HasSuffix(fields[0], ":") {
			// A mapping's header: range perms offset dev inode [path].
			if len(fields) < 5 {
				continue
			}
			path := ""
			if len(fields) > 5 {
				path = fields[5]
			}
			vmas = append(vmas, vma{anon: path == "" || path == "[heap]" || strings.HasPrefix(path, "[stack"), exec: strings.Contains(fields[1], "x") && path == ""})
			continue
		}
		if len(vmas) == 0 || len(fields) < 2 {
			continue
		}
		kb, err := strconv.Atoi(fields[1])
		if err != nil {
			continue
		}
		v := &vmas[len(vmas)-1]
		switch fields[0] {
		case "Size:":
			v.size = kb
		case "Rss:":
			v.rss = kb
		case "Pss:":
			v.pss = kb
		case "AnonHugePages:":
			v.thp = kb
		}
	}
	if err := sc.Err(); err != nil {
		return VMMemory{}, err
	}
	// The guest's RAM: the largest anonymous mapping of at least the guest's size.
	guest := -1
	for i, v := range vmas {
		if v.anon && !v.exec && v.size >= guestMB<<10 && (guest < 0 || v.size > vmas[guest].size) {
			guest = i
		}
	}
	var m VMMemory
	for i, v := range vmas {
		m.RSS += v.rss
		m.PSS += v.pss
		switch {
		case i == guest:
			m.GuestRSS, m.GuestTHP = v.rss, v.thp
		case v.exec:
			m.TCGRSS += v.rss
		case v.anon:
			m.OwnAnonRSS += v.rss
		default:
			m.OwnFileRSS += v.rss
			m.OwnFilePSS += v.pss
		}
	}
	if guest < 0 {
		return m, fmt.Errorf("qemu %d: no mapping of the guest's %d MiB", pid, guestMB)
	}
	return m, nil
}

// FindVMProcess returns the pid of the QEMU process (of any runtime on the host) of
// instance id, found by its -name in /proc, or 0.
func FindVMProcess(id string) int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
		if err != nil {
			continue
		}
		argv := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(argv) < 3 || !strings.HasPrefix(argv[0][strings.LastIndexByte(argv[0], '/')+1:], "qemu-system") {
			continue
		}
		if i := slices.Index(argv, "-name"); i >= 0 && i+1 < len(argv) && strings.HasPrefix(argv[i+1], "space-") && strings.HasSuffix(argv[i+1], "-"+id) {
			return pid
		}
	}
	return 0
}

// GuestUsedKB reads MemTotal − MemFree (KiB) from the text of a guest's /proc/meminfo:
// what its kernel holds, page cache included.
func GuestUsedKB(meminfo string) (int, error) {
	var total, free int
	for _, l := range strings.Split(meminfo, "\n") {
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
