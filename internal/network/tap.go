package network

import (
	"fmt"
	"net"
	"net/netip"
	"os"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Tap networking for VM runtimes, in the routed form: the VM's NIC is a tap device in
// the sandbox's namespace, the guest has a fixed private address behind it, and the
// namespace masquerades the guest's traffic to its eth0. The host-side rules then see
// the sandbox's address exactly as for gVisor, and every clone of a VM wakes with the
// same guest address (it is in the snapshot), whatever namespace and address it gets.
// The masquerade inside the namespace is the runtime's plumbing, not a policy layer:
// everything leaving the namespace still crosses the host's rules.
var (
	// TapGuest is the guest's address and network on the tap.
	TapGuest = netip.MustParsePrefix("10.0.2.15/24")
	// TapGateway is the namespace's address on the tap: the guest's default route.
	TapGateway = netip.MustParseAddr("10.0.2.2")
)

// TapName is the tap device's name in the sandbox's namespace.
const TapName = "tap0"

// tapMAC is the tap's own MAC address, the same in every namespace: a restored or
// cloned guest keeps the gateway's MAC in its ARP cache, and a frame to another MAC
// would be dropped by the new tap.
var tapMAC = net.HardwareAddr{0x52, 0x54, 0x00, 0x73, 0x70, 0x02}

// tapTable is the nftables table of the masquerade inside a sandbox's namespace.
const tapTable = "space_tap"

// TapGuestConfig is the shell command that gives a VM guest its network on the tap:
// the link up, TapGuest, the default route via TapGateway (iproute2's ip; replace
// makes it safe to repeat, e.g. after a restore, where the guest has it already).
func TapGuestConfig() []string {
	return []string{"/bin/sh", "-c", fmt.Sprintf(
		"set -e; dev=$(ls /sys/class/net | grep -v '^lo$' | head -n1); test -n \"$dev\"; "+
			"ip link set \"$dev\" up && ip addr replace %s dev \"$dev\" && ip route replace default via %s dev \"$dev\"",
		TapGuest, TapGateway)}
}

// OpenTap creates the tap device of a VM in the sandbox's namespace netnsPath (with its
// address, IP forwarding and the masquerade to eth0) and returns its descriptor, for
// the VMM (-netdev tap,fd=N). The device lives as long as a descriptor of it is open:
// when the VM ends, it goes. Repeating it (a restore) sets everything up again.
func OpenTap(netnsPath string) (*os.File, error) {
	ns, err := OpenNS(netnsPath)
	if err != nil {
		return nil, err
	}
	defer ns.Close()
	var tap *os.File
	err = ns.Do(func() error {
		// The device is made in the namespace of the thread that opens the clone device.
		fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open /dev/net/tun: %w", err)
		}
		ifr, err := unix.NewIfreq(TapName)
		if err != nil {
			unix.Close(fd)
			return err
		}
		ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
		if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
			unix.Close(fd)
			return fmt.Errorf("create tap %s: %w", TapName, err)
		}
		tap = os.NewFile(uintptr(fd), TapName)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			tap.Close()
		}
	}()
	h, err := ns.netlink()
	if err != nil {
		return nil, fmt.Errorf("network: netlink in sandbox netns: %w", err)
	}
	defer h.Close()
	l, err := h.LinkByName(TapName)
	if err != nil {
		return nil, fmt.Errorf("network: tap: %w", err)
	}
	if err := h.LinkSetHardwareAddr(l, tapMAC); err != nil {
		return nil, fmt.Errorf("network: tap MAC: %w", err)
	}
	gw := netip.PrefixFrom(TapGateway, TapGuest.Bits())
	if err := h.AddrReplace(l, &netlink.Addr{IPNet: prefixNet(gw)}); err != nil {
		return nil, fmt.Errorf("network: tap address: %w", err)
	}
	if err := h.LinkSetUp(l); err != nil {
		return nil, fmt.Errorf("network: tap up: %w", err)
	}
	if err := ns.WriteSysctl("net/ipv4/ip_forward", "1"); err != nil {
		return nil, fmt.Errorf("network: %w", err)
	}
	c, err := nftables.New(nftables.WithNetNSFd(ns.FD()))
	if err != nil {
		return nil, fmt.Errorf("network: nftables in sandbox netns: %w", err)
	}
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: tapTable}
	c.AddTable(t) // add, delete, add: the table is replaced whole
	c.DelTable(t)
	c.AddTable(t)
	post := c.AddChain(&nftables.Chain{Name: "post", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	c.AddRule(&nftables.Rule{Table: t, Chain: post, Exprs: cat(
		oifname(sandboxIf),
		[]expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: maskBytes(TapGuest.Bits()), Xor: []byte{0, 0, 0, 0}},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: TapGuest.Masked().Addr().AsSlice()},
		},
		[]expr.Any{&expr.Masq{}},
	)})
	if err := c.Flush(); err != nil {
		return nil, fmt.Errorf("network: tap masquerade: %w", err)
	}
	ok = true
	return tap, nil
}

// maskBytes is an IPv4 netmask of bits as bytes.
func maskBytes(bits int) []byte {
	m := uint32(0xffffffff) << (32 - bits)
	return []byte{byte(m >> 24), byte(m >> 16), byte(m >> 8), byte(m)}
}
