package vmboot

import (
	"bufio"
	"context"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hashicorp/yamux"
)

// fakePort imitates a virtio-serial port as QEMU and the guest driver present it: a
// guest device that can be opened (each open is a fresh pipe, unread input is dropped)
// and a host socket taking one client at a time. Bytes flow only while both a guest open
// and a host connection exist; a guest write blocks until a host is connected. The test
// chooses whether a host disconnect is reported to the guest (EOF on its read) or not
// (the guest keeps its session, as after a restore whose notification it has not seen).
type fakePort struct {
	mu    sync.Mutex
	cond  *sync.Cond
	guest net.Conn // relay end of the guest's open device
	host  net.Conn // relay end of the current host connection
	// relayed is closed once the relay of the guest's previous open has passed on all
	// it read: a device keeps the guest's bytes in order across a close and reopen
	// (what the old session wrote last reaches the host before the new handshake).
	relayed chan struct{}
}

func newFakePort() *fakePort {
	p := &fakePort{}
	p.cond = sync.NewCond(&p.mu)
	return p
}

// open is the guest's open(2) of the device.
func (p *fakePort) open() (io.ReadWriteCloser, error) {
	p.mu.Lock()
	prev := p.relayed
	p.mu.Unlock()
	if prev != nil {
		<-prev // the guest closed its previous open before this one
	}
	g, r := net.Pipe()
	relayed := make(chan struct{})
	p.mu.Lock()
	p.guest = r
	p.relayed = relayed
	p.cond.Broadcast()
	p.mu.Unlock()
	go func() { // guest → host
		defer close(relayed)
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			if err != nil {
				return
			}
			p.mu.Lock()
			for p.host == nil {
				p.cond.Wait()
			}
			h := p.host
			p.mu.Unlock()
			h.Write(buf[:n]) // a write to a dead host is lost, like in QEMU
		}
	}()
	return g, nil
}

// connect is a host connecting to the port's socket; it replaces the current host
// without telling the guest.
func (p *fakePort) connect() net.Conn {
	c, r := net.Pipe()
	p.mu.Lock()
	if p.host != nil {
		p.host.Close()
	}
	p.host = r
	p.cond.Broadcast()
	p.mu.Unlock()
	go func() { // host → guest
		buf := make([]byte, 4096)
		for {
			n, err := r.Read(buf)
			if err != nil {
				return
			}
			p.mu.Lock()
			g := p.guest
			p.mu.Unlock()
			if g != nil {
				g.Write(buf[:n])
			}
		}
	}()
	return c
}

// hangup drops the host connection and tells the guest (its read returns EOF).
func (p *fakePort) hangup() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.host != nil {
		p.host.Close()
		p.host = nil
	}
	if p.guest != nil {
		p.guest.Close()
		p.guest = nil
	}
}

// echoServer serves the listener: each stream echoes lines back prefixed with "echo ".
func echoServer(t *testing.T, ln net.Listener) {
	t.Helper()
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					io.WriteString(c, "echo "+sc.Text()+"\n")
				}
			})
		}
	})
}

func roundTrip(t *testing.T, sess *yamux.Session, msg string) {
	t.Helper()
	c, err := sess.Open()
	if err != nil {
		t.Fatalf("open stream: %v", err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(c, msg+"\n")
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || line != "echo "+msg+"\n" {
		t.Fatalf("round trip %q: %q, %v", msg, line, err)
	}
}

func testConnect(t *testing.T, p *fakePort) *yamux.Session {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sess, err := Connect(ctx, p.connect(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return sess
}

func TestSerialReconnect(t *testing.T) {
	p := newFakePort()
	ln, err := listen(context.Background(), "fake", p.open, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	echoServer(t, ln)

	s1 := testConnect(t, p)
	roundTrip(t, s1, "one")
	roundTrip(t, s1, "two")

	// Node restart: the host goes away and the guest is told.
	s1.Close()
	p.hangup()
	s2 := testConnect(t, p)
	roundTrip(t, s2, "three")

	// Restore: a new host connects while the guest still runs the old session with
	// nothing telling it; the handshake must still get both ends in step, repeatedly.
	for i := range 3 {
		s3 := testConnect(t, p)
		roundTrip(t, s3, strings.Repeat("x", i+1))
		if !s2.IsClosed() {
			// The replaced connection is dead for the host too.
			select {
			case <-s2.CloseChan():
			case <-time.After(5 * time.Second):
				t.Fatal("old host session still open")
			}
		}
		s2 = s3
	}
	s2.Close()
}

func TestSerialConnectCancel(t *testing.T) {
	p := newFakePort() // nobody opens the guest side
	ctx, cancel := context.WithTimeout(context.Background(), 3*ResendInterval)
	defer cancel()
	start := time.Now()
	if _, err := Connect(ctx, p.connect(), nil); err == nil {
		t.Fatal("handshake without guest succeeded")
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("Connect returned after %v, long after its context ended", d)
	}
}

func TestSerialListenerClose(t *testing.T) {
	p := newFakePort()
	ln, err := listen(context.Background(), "fake", p.open, nil)
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan error, 1)
	go func() {
		_, err := ln.Accept()
		accepted <- err
	}()
	done := make(chan struct{})
	go func() { ln.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Close blocked (guest was waiting for a host)")
	}
	if err := <-accepted; err == nil {
		t.Fatal("Accept after Close succeeded")
	}
}

func TestModuleParams(t *testing.T) {
	got := moduleParams(strings.Fields("console=hvc0 virtio_mmio.device=4K@0xfeb00000:12 virtio-mmio.device=4K@0xfeb00200:13 space.vm=1 quiet"))
	if want := "device=4K@0xfeb00000:12 device=4K@0xfeb00200:13"; got["virtio_mmio"] != want {
		t.Errorf("virtio_mmio params %q, want %q", got["virtio_mmio"], want)
	}
	if ModuleName("kernel/drivers/char/hw_random/virtio-rng.ko.zst") != "virtio_rng" {
		t.Error("ModuleName")
	}
}

func TestEnvRoundTrip(t *testing.T) {
	arg, err := EncodeEnv(map[string]string{"A": "b c", "SPACE_AGENT_LOG_LEVEL": "debug"})
	if err != nil {
		t.Fatal(err)
	}
	if strings.ContainsAny(arg, " \"") {
		t.Fatalf("kernel parameter %q has spaces or quotes", arg)
	}
	env, err := decodeEnv([]string{"quiet", arg})
	if err != nil || env["A"] != "b c" || env["SPACE_AGENT_LOG_LEVEL"] != "debug" {
		t.Fatalf("decoded %v, %v", env, err)
	}
	full := agentEnvironment(env)
	if !strings.Contains(strings.Join(full, "\n"), "SPACE_AGENT_LISTEN="+DefaultListen) {
		t.Errorf("environment lacks the default listen address: %v", full)
	}
}
