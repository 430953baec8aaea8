package agent

import (
	"os"
	"path/filepath"
	"testing"
)

func TestEnsureHostsEntry(t *testing.T) {
	hosts := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hosts, []byte("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	read := func() string {
		b, err := os.ReadFile(hosts)
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	if err := ensureHostsEntry(hosts, "abc"); err != nil {
		t.Fatal(err)
	}
	want := "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\tabc\t" + hostsMarker + "\n"
	if got := read(); got != want {
		t.Fatalf("first name:\n%q\nwant\n%q", got, want)
	}
	// A clone's new name replaces the line (not another one beside it).
	if err := ensureHostsEntry(hosts, "def"); err != nil {
		t.Fatal(err)
	}
	want = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n127.0.1.1\tdef\t" + hostsMarker + "\n"
	if got := read(); got != want {
		t.Fatalf("new name:\n%q\nwant\n%q", got, want)
	}
	// The same name again (a warm-pool member's claim) leaves the file as it is.
	before, err := os.Stat(hosts)
	if err != nil {
		t.Fatal(err)
	}
	if err := ensureHostsEntry(hosts, "def"); err != nil {
		t.Fatal(err)
	}
	if after, err := os.Stat(hosts); err != nil || !os.SameFile(before, after) || read() != want {
		t.Fatalf("the same name rewrote the file: %v %q", err, read())
	}
	// A file that names the host itself is left alone.
	own := "10.0.0.5 myhost\n"
	if err := os.WriteFile(hosts, []byte(own), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := ensureHostsEntry(hosts, "myhost"); err != nil || read() != own {
		t.Fatalf("own entry: %v %q", err, read())
	}
	// Two names (the runtime's, kept when sethostname is refused, and the identity's).
	os.Remove(hosts)
	if err := ensureHostsEntry(hosts, "sandbox-ab", "abcdef", "sandbox-ab"); err != nil || read() != "127.0.1.1\tsandbox-ab abcdef\t"+hostsMarker+"\n" {
		t.Fatalf("two names: %v %q", err, read())
	}
	// No file: one is made.
	os.Remove(hosts)
	if err := ensureHostsEntry(hosts, "x"); err != nil || read() != "127.0.1.1\tx\t"+hostsMarker+"\n" {
		t.Fatalf("no file: %v %q", err, read())
	}
}
