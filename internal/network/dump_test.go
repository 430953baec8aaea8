package network_test

import (
	"errors"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/spacedev/space/internal/network"
)

// TestDumpAgainWhenInterrupted: a netlink dump the kernel interrupted (the table
// changed while it was read) is run again, and its complete list returned; one
// interrupted every time fails after DumpTries tries; any other error at once.
func TestDumpAgainWhenInterrupted(t *testing.T) {
	tries := 0
	got, err := network.Dump(func() ([]int, error) {
		tries++
		if tries < 3 {
			return []int{1}, netlink.ErrDumpInterrupted
		}
		return []int{1, 2}, nil
	})
	if err != nil || len(got) != 2 || tries != 3 {
		t.Fatalf("interrupted twice: %v %v after %d tries", got, err, tries)
	}
	tries = 0
	if _, err := network.Dump(func() ([]int, error) { tries++; return nil, netlink.ErrDumpInterrupted }); !errors.Is(err, netlink.ErrDumpInterrupted) || tries != network.DumpTries {
		t.Fatalf("interrupted every time: %v after %d tries", err, tries)
	}
	tries = 0
	other := errors.New("no such device")
	if _, err := network.Dump(func() ([]int, error) { tries++; return nil, other }); err != other || tries != 1 {
		t.Fatalf("another error: %v after %d tries", err, tries)
	}
}
