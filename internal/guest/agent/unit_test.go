package agent

import (
	"bytes"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/spacedev/space/internal/guest/wire"
)

// readAll reads the journal from `from` to its end, checking that reads stop at
// stream boundaries.
func readAll(t *testing.T, j *journal, from int64, bufSize int) (data []byte, streams []byte, gap int64) {
	t.Helper()
	buf := make([]byte, bufSize)
	pos := from
	for {
		stream, n, g := j.readAt(pos, buf)
		if g > 0 {
			if gap != 0 || pos != from {
				t.Fatalf("second gap at %d", pos)
			}
			gap = g
			pos += g
			continue
		}
		if n == 0 {
			return data, streams, gap
		}
		data = append(data, buf[:n]...)
		streams = append(streams, bytes.Repeat([]byte{stream}, n)...)
		pos += int64(n)
	}
}

func TestJournalModel(t *testing.T) {
	// Compare the journal against a trivially correct model over random writes.
	for _, max := range []int{1, 7, 100, 4096, 10000} {
		rng := rand.New(rand.NewPCG(uint64(max), 42))
		j := newJournal(max, nil)
		var all, allStreams []byte
		for i := 0; i < 2000; i++ {
			n := rng.IntN(300) + 1
			if rng.IntN(50) == 0 {
				n = rng.IntN(3*max) + 1
			}
			stream := wire.FrameStdout
			if rng.IntN(3) == 0 {
				stream = wire.FrameStderr
			}
			p := make([]byte, n)
			for k := range p {
				p[k] = byte(rng.Uint32())
			}
			j.append(stream, p)
			all = append(all, p...)
			allStreams = append(allStreams, bytes.Repeat([]byte{stream}, n)...)

			first, end := j.bounds()
			if end != int64(len(all)) {
				t.Fatalf("max %d: end %d, want %d", max, end, len(all))
			}
			if end-first > int64(max) {
				t.Fatalf("max %d: retains %d bytes", max, end-first)
			}
			if i%97 == 0 || i == 1999 {
				from := first
				if end > first {
					from = first + rng.Int64N(end-first)
				}
				data, streams, gap := readAll(t, j, from, rng.IntN(500)+1)
				if gap != 0 || !bytes.Equal(data, all[from:]) || !bytes.Equal(streams, allStreams[from:]) {
					t.Fatalf("max %d: read from %d mismatch (gap %d, %d bytes)", max, from, gap, len(data))
				}
				if first > 0 {
					_, _, gap := readAll(t, j, 0, 1000)
					if gap != first {
						t.Fatalf("max %d: gap %d, want %d", max, gap, first)
					}
				}
			}
		}
	}
}

func TestJournalGrowsLazily(t *testing.T) {
	j := newJournal(8<<20, nil)
	j.append(wire.FrameStdout, []byte("hello\n"))
	if len(j.buf) > journalMinBuf {
		t.Fatalf("small output allocated %d bytes", len(j.buf))
	}
	j.append(wire.FrameStdout, make([]byte, 100000))
	if len(j.buf) < 100006 || len(j.buf) > 8<<20 {
		t.Fatalf("buffer %d bytes", len(j.buf))
	}
	data, _, _ := readAll(t, j, 0, 7)
	if string(data[:6]) != "hello\n" || len(data) != 100006 {
		t.Fatalf("lost data across growth: %q... %d bytes", data[:6], len(data))
	}
}

func TestJournalSegmentBound(t *testing.T) {
	j := newJournal(1<<20, nil)
	for i := 0; i < 10*j.maxSegs; i++ {
		s := wire.FrameStdout
		if i%2 == 1 {
			s = wire.FrameStderr
		}
		j.append(s, []byte{'x'})
	}
	if live := len(j.segs) - j.segHead; live > j.maxSegs {
		t.Fatalf("%d live segments, bound %d", live, j.maxSegs)
	}
	if cap(j.segs) > 4*j.maxSegs {
		t.Fatalf("segment slice capacity %d grows without bound", cap(j.segs))
	}
	first, end := j.bounds()
	data, streams, _ := readAll(t, j, first, 100)
	if int64(len(data)) != end-first {
		t.Fatalf("read %d bytes, want %d", len(data), end-first)
	}
	for i, s := range streams {
		want := wire.FrameStdout
		if (first+int64(i))%2 == 1 {
			want = wire.FrameStderr
		}
		if s != want {
			t.Fatalf("byte %d has stream %d, want %d", first+int64(i), s, want)
		}
	}
}

func TestParsePasswdGroup(t *testing.T) {
	users, err := parsePasswd(strings.NewReader(`# comment
root:x:0:0:root:/root:/bin/bash
user:x:1000:1000:User,,,:/home/user:/bin/bash
broken:x:abc:1:::
+nis
short:x:1
`))
	if err != nil {
		t.Fatal(err)
	}
	if len(users) != 2 || users[1].name != "user" || users[1].uid != 1000 || users[1].home != "/home/user" {
		t.Fatalf("users = %+v", users)
	}
	groups, err := parseGroup(strings.NewReader("root:x:0:\nuser:x:1000:\ndocker:x:999:user, other\nsudo:x:27:other\n"))
	if err != nil {
		t.Fatal(err)
	}
	if len(groups) != 4 || groups[2].name != "docker" || len(groups[2].members) != 2 || groups[2].members[1] != "other" {
		t.Fatalf("groups = %+v", groups)
	}
}

func TestPermissionString(t *testing.T) {
	for _, tc := range []struct {
		mode uint32
		want string
	}{
		{syscall.S_IFREG | 0o644, "-rw-r--r--"},
		{syscall.S_IFDIR | 0o755, "drwxr-xr-x"},
		{syscall.S_IFLNK | 0o777, "lrwxrwxrwx"},
		{syscall.S_IFREG | 0o4755, "-rwsr-xr-x"},
		{syscall.S_IFDIR | 0o2750, "drwxr-s---"},
		{syscall.S_IFDIR | 0o1777, "drwxrwxrwt"},
		{syscall.S_IFREG | 0o4644, "-rwSr--r--"},
		{syscall.S_IFIFO | 0o600, "prw-------"},
	} {
		if got := permissionString(tc.mode); got != tc.want {
			t.Errorf("permissionString(%o) = %q, want %q", tc.mode, got, tc.want)
		}
	}
}

func TestParseSignal(t *testing.T) {
	for in, want := range map[string]unix.Signal{
		"SIGTERM": unix.SIGTERM, "TERM": unix.SIGTERM, "term": unix.SIGTERM, "9": unix.SIGKILL,
		"SIGUSR1": unix.SIGUSR1, " hup ": unix.SIGHUP,
	} {
		got, err := parseSignal(in)
		if err != nil || got != want {
			t.Errorf("parseSignal(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "BOGUS", "SIGBOGUS", "0", "-1", "65"} {
		if _, err := parseSignal(in); err == nil {
			t.Errorf("parseSignal(%q) succeeded", in)
		}
	}
}

func TestResolvePath(t *testing.T) {
	acct := account{Name: "user", Home: "/home/user"}
	for in, want := range map[string]string{
		"/etc/../etc/passwd": "/etc/passwd",
		"a/b":                "/home/user/a/b",
		"~":                  "/home/user",
		"~/x/":               "/home/user/x",
		"../../etc":          "/etc",
		"~other":             "/home/user/~other",
	} {
		got, err := resolvePath(acct, in)
		if err != nil || got != want {
			t.Errorf("resolvePath(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := resolvePath(acct, ""); err == nil {
		t.Error("empty path accepted")
	}
}

func TestParseListen(t *testing.T) {
	for _, ok := range []string{"unix:/run/space/agent.sock", "vsock:1024", "serial:/dev/vport0p1"} {
		if _, err := parseListen(ok); err != nil {
			t.Errorf("parseListen(%q): %v", ok, err)
		}
	}
	for _, bad := range []string{"", "unix:", "unix:rel.sock", "vsock:x", "tcp:1.2.3.4:5"} {
		if _, err := parseListen(bad); err == nil {
			t.Errorf("parseListen(%q) succeeded", bad)
		}
	}
}
