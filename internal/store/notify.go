package store

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
)

// Notification channels.
const (
	// ChannelController wakes the controller (payload: sandbox id).
	ChannelController = "space_controller"
	// ChannelOperations announces operation changes (payload: operation id).
	ChannelOperations = "space_operations"
	// ChannelSandboxes announces sandbox changes: new sandboxes, new intent, observed
	// state (payload: sandbox id).
	ChannelSandboxes = "space_sandboxes"
	// ChannelTokens announces token revocations (payload: sandbox id).
	ChannelTokens = "space_tokens"
	// ChannelKeys announces API key revocations (payload: key id; "" when several
	// keys went at once, e.g. with their tenant).
	ChannelKeys = "space_keys"
)

// NodeChannel is the channel that wakes one node (payload: sandbox id).
func NodeChannel(nodeID string) string { return "space_node_" + nodeID }

// Notify sends a notification when the transaction commits.
func (t *Tx) Notify(ctx context.Context, channel, payload string) error {
	_, err := t.tx.Exec(ctx, `SELECT pg_notify($1, $2)`, channel, payload)
	if err != nil {
		return fmt.Errorf("notify %s: %w", channel, err)
	}
	return nil
}

// Notify sends a notification now.
func (s *Store) Notify(ctx context.Context, channel, payload string) error {
	_, err := s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, channel, payload)
	if err != nil {
		return fmt.Errorf("notify %s: %w", channel, err)
	}
	return nil
}

// Listen delivers notifications on the given channels to fn until ctx ends, reconnecting
// after failures. fn must not block for long. After every (re)connect, once the
// connection listens on every channel, fn is called once per channel with an empty
// payload, so callers can resync state they may have missed: a notification sent
// after that call reaches fn. (pgxlisten calls its backlog handler after each
// channel's LISTEN, before the next channel's; a caller that took the first channel's
// call for "listening" and acted on it could miss a notification on a channel not yet
// listened to: the event streams' TestEventStream did, once in CI.)
func (s *Store) Listen(ctx context.Context, log *slog.Logger, fn func(channel, payload string), channels ...string) error {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) { return s.Connect(ctx) },
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() == nil {
				log.Warn("listen", "err", err)
			}
		},
		ReconnectDelay: time.Second,
	}
	h := &listenHandler{fn: fn, channels: channels}
	for _, ch := range channels {
		l.Handle(ch, h)
	}
	return l.Listen(ctx)
}

// listenHandler hands notifications to fn, and the resync calls once a connection
// listens on all channels.
type listenHandler struct {
	fn       func(channel, payload string)
	channels []string

	// The listener connects, LISTENs and calls HandleBacklog from one goroutine, one
	// connection at a time; the mutex only documents that nothing else touches these.
	mu       sync.Mutex
	conn     *pgx.Conn // the connection the backlog calls are counted for
	listened int       // channels listened to on conn
}

func (h *listenHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h.fn(n.Channel, n.Payload)
	return nil
}

// HandleBacklog runs after each channel's LISTEN of a (re)connect; after the last one
// it tells the caller to resync, once per channel.
func (h *listenHandler) HandleBacklog(_ context.Context, _ string, conn *pgx.Conn) error {
	h.mu.Lock()
	if conn != h.conn {
		h.conn, h.listened = conn, 0
	}
	h.listened++
	all := h.listened == len(h.channels)
	h.mu.Unlock()
	if all {
		for _, ch := range h.channels {
			h.fn(ch, "")
		}
	}
	return nil
}
