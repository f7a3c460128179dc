// pg-transactional-outbox as shipped (0.5.7, its defaults), reading its
// outbox from the WAL and publishing each message's payload to NATS
// JetStream: the peer that `relay-bench --steady --peer` runs beside
// Switchyard on the same PostgreSQL, NATS, payloads and subscriber.
//
//   node relay.js setup   creates its table, publication and slot
//   node relay.js run     relays until SIGTERM
//
// Connects to DATABASE_URL and NATS_URL.

'use strict';

const { Client } = require('pg');
const { connect, StringCodec } = require('nats');
const {
  DatabaseSetup,
  getDefaultLogger,
  initializeReplicationMessageListener,
} = require('pg-transactional-outbox');

const table = { outboxOrInbox: 'outbox', schema: 'public', table: 'outbox' };
const publication = 'peer_outbox_pub';
const slot = 'peer_outbox_slot';
const db = { connectionString: process.env.DATABASE_URL };

async function setup() {
  const client = new Client(db);
  await client.connect();
  await client.query(DatabaseSetup.dropAndCreateTable(table));
  await client.query(`DROP PUBLICATION IF EXISTS ${publication}`);
  await client.query(`CREATE PUBLICATION ${publication} FOR TABLE public.outbox WITH (publish = 'insert')`);
  await client.query(`SELECT pg_create_logical_replication_slot('${slot}', 'pgoutput')`);
  await client.end();
}

async function run() {
  const nc = await connect({ servers: process.env.NATS_URL });
  const jsm = await nc.jetstreamManager();
  await jsm.streams.add({ name: 'BENCH', subjects: ['bench.>'] }).catch(() => {});
  const js = nc.jetstream();
  const codec = StringCodec();
  const handler = {
    handle: async (message) => {
      await js.publish(`bench.peer.${message.messageType}`, codec.encode(JSON.stringify(message.payload)), {
        msgID: message.id,
      });
    },
  };
  const logger = getDefaultLogger('peer');
  logger.level = 'warn';
  const [shutdown] = initializeReplicationMessageListener(
    {
      outboxOrInbox: 'outbox',
      dbListenerConfig: db,
      dbHandlerConfig: db,
      settings: { dbSchema: 'public', dbTable: 'outbox', dbPublication: publication, dbReplicationSlot: slot },
    },
    handler,
    logger,
  );
  process.on('SIGTERM', async () => {
    await shutdown();
    await nc.drain();
    process.exit(0);
  });
  process.stdout.write('ready\n');
}

const command = process.argv[2];
(command === 'setup' ? setup() : command === 'run' ? run() : Promise.reject(new Error(`unknown command ${command}`))).catch(
  (error) => {
    console.error(error);
    process.exit(1);
  },
);
